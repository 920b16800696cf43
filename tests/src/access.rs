//! What the apiserver's authorizer lets a ServiceAccount do, asked with SubjectAccessReviews,
//! and every resource it serves, read from discovery.

use anyhow::{Context, Result};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::Client;
use kube::api::{Api, PostParams};

/// A ServiceAccount as the authorizer sees a request made with its token.
#[derive(Clone, Debug)]
pub struct ServiceAccount {
    pub namespace: String,
    pub name: String,
}

impl ServiceAccount {
    pub fn new(namespace: &str, name: &str) -> Self {
        ServiceAccount {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        }
    }

    fn user(&self) -> String {
        format!("system:serviceaccount:{}:{}", self.namespace, self.name)
    }

    fn groups(&self) -> Vec<String> {
        vec![
            "system:serviceaccounts".to_owned(),
            format!("system:serviceaccounts:{}", self.namespace),
            "system:authenticated".to_owned(),
        ]
    }
}

/// One request the authorizer decides on: `verb` on `group`'s `resource` (`pods` or
/// `pods/exec`) in `namespace`, or across all namespaces (and for cluster-scoped resources)
/// when it is `None`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Access {
    pub verb: String,
    pub group: String,
    pub resource: String,
    pub namespace: Option<String>,
}

impl Access {
    pub fn new(verb: &str, group: &str, resource: &str, namespace: Option<&str>) -> Self {
        Access {
            verb: verb.to_owned(),
            group: group.to_owned(),
            resource: resource.to_owned(),
            namespace: namespace.map(str::to_owned),
        }
    }
}

impl std::fmt::Display for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let group = if self.group.is_empty() {
            "core"
        } else {
            &self.group
        };
        let scope = self.namespace.as_deref().unwrap_or("all namespaces");
        write!(f, "{} {group}/{} in {scope}", self.verb, self.resource)
    }
}

/// Whether the apiserver allows `account` `access`.
pub async fn allowed(client: &Client, account: &ServiceAccount, access: &Access) -> Result<bool> {
    let (resource, subresource) = match access.resource.split_once('/') {
        Some((resource, subresource)) => (resource, Some(subresource.to_owned())),
        None => (access.resource.as_str(), None),
    };
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(account.user()),
            groups: Some(account.groups()),
            resource_attributes: Some(ResourceAttributes {
                verb: Some(access.verb.clone()),
                group: Some(access.group.clone()),
                resource: Some(resource.to_owned()),
                subresource,
                namespace: access.namespace.clone(),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let answer = Api::<SubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
        .with_context(|| format!("reviewing {access} for {}", account.user()))?;
    Ok(answer.status.is_some_and(|s| s.allowed))
}

/// A resource the apiserver serves (its preferred version), with its verbs.
#[derive(Clone, Debug)]
pub struct ServedResource {
    pub group: String,
    /// `pods`, or `pods/exec` for a subresource.
    pub resource: String,
    pub namespaced: bool,
    pub verbs: Vec<String>,
}

/// Every resource and subresource the apiserver serves, except those of `skip_groups`
/// (aggregated APIs whose server is not running cannot be listed).
pub async fn served_resources(
    client: &Client,
    skip_groups: &[&str],
) -> Result<Vec<ServedResource>> {
    let mut lists = vec![(String::new(), client.list_core_api_resources("v1").await?)];
    for group in client.list_api_groups().await?.groups {
        if skip_groups.contains(&group.name.as_str()) {
            continue;
        }
        let version = group
            .preferred_version
            .or_else(|| group.versions.first().cloned())
            .with_context(|| format!("API group {} has no version", group.name))?;
        let list = client
            .list_api_group_resources(&version.group_version)
            .await
            .with_context(|| format!("discovering {}", version.group_version))?;
        lists.push((group.name, list));
    }
    Ok(lists
        .into_iter()
        .flat_map(|(group, list)| {
            list.resources.into_iter().map(move |r| ServedResource {
                group: group.clone(),
                resource: r.name,
                namespaced: r.namespaced,
                verbs: r.verbs,
            })
        })
        .collect())
}

/// A namespace of `cluster` for `test` that enforces the restricted Pod Security Standard, so
/// that every pod made in it is admitted only as that standard allows.
pub async fn restricted_namespace(
    cluster: &crate::cluster::Cluster,
    client: &Client,
    test: &str,
) -> Result<String> {
    let ns = cluster.namespace(client, test).await?;
    let labels = serde_json::json!({"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": "restricted",
    }}});
    Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
        .patch(
            &ns,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&labels),
        )
        .await?;
    Ok(ns)
}
