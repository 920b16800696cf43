//! Both directions of trust between kube-apiserver's aggregator and the external metrics
//! server, with no `insecureSkipTLSVerify` and no open port:
//!
//! - the aggregator trusts the server: the operator makes a CA and a serving certificate
//!   signed by it, keeps them in one Secret (so every operator replica serves the same
//!   certificate), and writes the CA into the APIService's `caBundle`;
//! - the server trusts only the aggregator: a metric request must come over a client
//!   certificate signed by the request-header CA that kube-apiserver publishes in
//!   `kube-system/extension-apiserver-authentication`, with a common name among its
//!   `requestheader-allowed-names` (as every extension API server checks it).
//!
//! kube-apiserver authorises the user (RBAC on `external.metrics.k8s.io`) before it proxies,
//! so the certificate is the server's proof that the request went through that check.

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::Context;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::labels::FIELD_MANAGER;

/// The APIService the chart registers for this server.
pub const API_SERVICE: &str = "v1beta1.external.metrics.k8s.io";
/// Where kube-apiserver publishes the CAs an extension API server authenticates it with.
pub const AUTHENTICATION_CONFIG_MAP: (&str, &str) =
    ("kube-system", "extension-apiserver-authentication");
const REQUEST_HEADER_CA_KEY: &str = "requestheader-client-ca-file";
const REQUEST_HEADER_ALLOWED_NAMES_KEY: &str = "requestheader-allowed-names";

const CA_KEY: &str = "ca.crt";
const CERT_KEY: &str = "tls.crt";
const PRIVATE_KEY_KEY: &str = "tls.key";
/// On the Secret: the names the serving certificate covers and when it expires, so a
/// changed Service name or an ageing certificate is noticed without parsing X.509.
const NAMES_ANNOTATION: &str = "npufleet.io/serving-names";
const NOT_AFTER_ANNOTATION: &str = "npufleet.io/not-after";

/// The serving certificate lives a year and is renewed at start-up in its last month.
const VALID_DAYS: i64 = 365;
const RENEW_BEFORE_DAYS: i64 = 30;

/// The names a client may use for `service` in `namespace`.
pub fn service_dns_names(service: &str, namespace: &str, cluster_domain: &str) -> Vec<String> {
    vec![
        service.to_owned(),
        format!("{service}.{namespace}"),
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.{cluster_domain}"),
    ]
}

/// A serving certificate, its key and the CA that signed it, all PEM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServingCertificate {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
    pub not_after: Timestamp,
}

impl ServingCertificate {
    /// A fresh CA and a certificate for `dns_names` signed by it.
    pub fn generate(dns_names: &[String]) -> anyhow::Result<Self> {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
            KeyPair, KeyUsagePurpose,
        };
        anyhow::ensure!(
            !dns_names.is_empty(),
            "a serving certificate needs at least one DNS name"
        );
        let now = Timestamp::now();
        let not_after = now + SignedDuration::from_hours(24 * VALID_DAYS);
        // Whole days: a day's margin before now absorbs clock skew between machines.
        let validity = |params: &mut CertificateParams| {
            let (year, month, day) = utc_date(now - SignedDuration::from_hours(24));
            params.not_before = rcgen::date_time_ymd(year, month, day);
            let (year, month, day) = utc_date(not_after);
            params.not_after = rcgen::date_time_ymd(year, month, day);
        };

        let ca_key = KeyPair::generate().context("generating the CA key")?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "npufleet-external-metrics-ca");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        validity(&mut ca_params);
        let ca_cert = ca_params
            .self_signed(&ca_key)
            .context("signing the CA certificate")?;
        let issuer = Issuer::new(ca_params, ca_key);

        let key = KeyPair::generate().context("generating the serving key")?;
        let mut params = CertificateParams::new(dns_names.to_vec())
            .context("the serving certificate's DNS names")?;
        params
            .distinguished_name
            .push(DnType::CommonName, dns_names[0].as_str());
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        validity(&mut params);
        let cert = params
            .signed_by(&key, &issuer)
            .context("signing the serving certificate")?;
        Ok(Self {
            ca_pem: ca_cert.pem(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            not_after,
        })
    }

    fn from_secret(secret: &Secret, dns_names: &[String]) -> Option<Self> {
        let data = secret.data.as_ref()?;
        let text = |key: &str| String::from_utf8(data.get(key)?.0.clone()).ok();
        let annotations = secret.annotations();
        if annotations.get(NAMES_ANNOTATION)? != &dns_names.join(",") {
            return None;
        }
        let not_after: Timestamp = annotations.get(NOT_AFTER_ANNOTATION)?.parse().ok()?;
        if not_after < Timestamp::now() + SignedDuration::from_hours(24 * RENEW_BEFORE_DAYS) {
            return None;
        }
        Some(Self {
            ca_pem: text(CA_KEY)?,
            cert_pem: text(CERT_KEY)?,
            key_pem: text(PRIVATE_KEY_KEY)?,
            not_after,
        })
    }

    fn to_secret(&self, namespace: &str, name: &str, dns_names: &[String]) -> Secret {
        let bytes = |text: &str| ByteString(text.as_bytes().to_vec());
        Secret {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                namespace: Some(namespace.to_owned()),
                annotations: Some(BTreeMap::from([
                    (NAMES_ANNOTATION.to_owned(), dns_names.join(",")),
                    (NOT_AFTER_ANNOTATION.to_owned(), self.not_after.to_string()),
                ])),
                ..ObjectMeta::default()
            },
            // Opaque: a Secret's type is immutable, and the chart creates it empty.
            type_: Some("Opaque".to_owned()),
            data: Some(BTreeMap::from([
                (CA_KEY.to_owned(), bytes(&self.ca_pem)),
                (CERT_KEY.to_owned(), bytes(&self.cert_pem)),
                (PRIVATE_KEY_KEY.to_owned(), bytes(&self.key_pem)),
            ])),
            ..Secret::default()
        }
    }

    /// The certificate in Secret `namespace/name`, made (or renewed) there first when it is
    /// missing, covers other names or expires within a month. Replicas racing to make it
    /// all end up with the one that was written first.
    pub async fn ensure_in_secret(
        client: &Client,
        namespace: &str,
        name: &str,
        dns_names: &[String],
    ) -> anyhow::Result<Self> {
        let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
        let params = PostParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..PostParams::default()
        };
        for _ in 0..5 {
            let existing = api
                .get_opt(name)
                .await
                .with_context(|| format!("reading Secret {namespace}/{name}"))?;
            if let Some(current) = existing
                .as_ref()
                .and_then(|s| Self::from_secret(s, dns_names))
            {
                return Ok(current);
            }
            let fresh = Self::generate(dns_names)?;
            let mut secret = fresh.to_secret(namespace, name, dns_names);
            let written = match existing {
                Some(old) => {
                    secret.metadata.resource_version = old.resource_version();
                    api.replace(name, &params, &secret).await
                }
                None => api.create(&params, &secret).await,
            };
            match written {
                Ok(_) => return Ok(fresh),
                // Another replica wrote first: use its certificate.
                Err(kube::Error::Api(status)) if status.code == 409 => continue,
                Err(error) => {
                    return Err(error)
                        .with_context(|| format!("writing Secret {namespace}/{name}"));
                }
            }
        }
        anyhow::bail!(
            "Secret {namespace}/{name} kept changing while the serving certificate was written"
        )
    }
}

/// The UTC calendar date `at` falls in, as rcgen takes validity dates.
fn utc_date(at: Timestamp) -> (i32, u8, u8) {
    let date = at.to_zoned(k8s_openapi::jiff::tz::TimeZone::UTC).date();
    (
        i32::from(date.year()),
        u8::try_from(date.month()).unwrap_or(1),
        u8::try_from(date.day()).unwrap_or(1),
    )
}

/// Writes `ca_pem` into the APIService's `caBundle` (and turns `insecureSkipTLSVerify` off),
/// so the aggregator verifies the serving certificate. `Ok(false)` when the APIService is
/// not registered (another adapter serves the API, or the chart turned it off).
pub async fn publish_ca_bundle(client: &Client, ca_pem: &str) -> anyhow::Result<bool> {
    let api: Api<APIService> = Api::all(client.clone());
    if api
        .get_opt(API_SERVICE)
        .await
        .with_context(|| format!("reading APIService {API_SERVICE}"))?
        .is_none()
    {
        return Ok(false);
    }
    let patch = json!({
        "apiVersion": "apiregistration.k8s.io/v1",
        "kind": "APIService",
        "metadata": {"name": API_SERVICE},
        "spec": {
            "caBundle": ByteString(ca_pem.as_bytes().to_vec()),
            "insecureSkipTLSVerify": false,
        },
    });
    api.patch(
        API_SERVICE,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(patch),
    )
    .await
    .with_context(|| format!("writing the caBundle of APIService {API_SERVICE}"))?;
    Ok(true)
}

/// Whom the server lets read metrics: clients with a certificate from the request-header CA
/// whose common name is allowed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientAuth {
    /// PEM CA certificates.
    pub ca_pem: String,
    /// Common names a client certificate may carry; empty allows any the CA signed.
    pub allowed_names: Vec<String>,
}

impl ClientAuth {
    /// Reads the request-header CA and allowed names kube-apiserver publishes.
    pub async fn from_cluster(client: &Client) -> anyhow::Result<Self> {
        let (namespace, name) = AUTHENTICATION_CONFIG_MAP;
        let config_map = Api::<ConfigMap>::namespaced(client.clone(), namespace)
            .get(name)
            .await
            .with_context(|| format!("reading ConfigMap {namespace}/{name}"))?;
        Self::from_config_map(&config_map)
    }

    pub fn from_config_map(config_map: &ConfigMap) -> anyhow::Result<Self> {
        let (namespace, name) = AUTHENTICATION_CONFIG_MAP;
        let data = config_map.data.clone().unwrap_or_default();
        let ca_pem = data
            .get(REQUEST_HEADER_CA_KEY)
            .filter(|pem| !pem.trim().is_empty())
            .with_context(|| {
                format!(
                    "ConfigMap {namespace}/{name} has no {REQUEST_HEADER_CA_KEY}: kube-apiserver runs without --requestheader-client-ca-file, so the aggregator cannot prove who it is"
                )
            })?
            .clone();
        let allowed_names = match data.get(REQUEST_HEADER_ALLOWED_NAMES_KEY) {
            Some(names) if !names.trim().is_empty() => serde_json::from_str(names)
                .with_context(|| {
                    format!(
                        "{REQUEST_HEADER_ALLOWED_NAMES_KEY} in ConfigMap {namespace}/{name} is not a JSON list of names: {names:?}"
                    )
                })?,
            _ => Vec::new(),
        };
        Ok(Self {
            ca_pem,
            allowed_names,
        })
    }

    /// Whether a client whose verified certificate chain starts with `certificate` may read
    /// metrics; `Err` says why not.
    pub fn admit(&self, certificate: Option<&CertificateDer<'_>>) -> Result<(), Denied> {
        let Some(certificate) = certificate else {
            return Err(Denied::Unauthenticated);
        };
        let name = common_name(certificate).ok_or(Denied::NoCommonName)?;
        if self.allowed_names.is_empty() || self.allowed_names.contains(&name) {
            Ok(())
        } else {
            Err(Denied::NameNotAllowed {
                name,
                allowed: self.allowed_names.clone(),
            })
        }
    }
}

/// Why a metric request was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Denied {
    #[error(
        "a client certificate signed by kube-apiserver's request-header CA (kube-system/extension-apiserver-authentication) is required: reach this API through kube-apiserver"
    )]
    Unauthenticated,
    #[error("the client certificate has no common name")]
    NoCommonName,
    #[error("client certificate CN={name:?} is not among requestheader-allowed-names {allowed:?}")]
    NameNotAllowed { name: String, allowed: Vec<String> },
    #[error(
        "no request-header CA is configured, so no client can prove it is kube-apiserver; see the operator's log"
    )]
    NoClientCa,
}

fn common_name(certificate: &CertificateDer<'_>) -> Option<String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(certificate.as_ref()).ok()?;
    let name = parsed
        .subject()
        .iter_common_name()
        .next()?
        .as_str()
        .ok()?
        .to_owned();
    Some(name)
}

/// The rustls configuration: the serving certificate, and client certificates verified
/// against the request-header CA when there is one. A client without a certificate still
/// completes the handshake, so that it gets an HTTP 401 saying what is missing.
pub fn server_config(
    chain_pem: &str,
    key_pem: &str,
    client_auth: Option<&ClientAuth>,
) -> anyhow::Result<rustls::ServerConfig> {
    let chain = CertificateDer::pem_slice_iter(chain_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .context("parsing the serving certificate chain")?;
    anyhow::ensure!(!chain.is_empty(), "the serving certificate chain is empty");
    let key =
        PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).context("parsing the serving key")?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .context("selecting TLS versions")?;
    let builder = match client_auth {
        Some(auth) => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(auth.ca_pem.as_bytes()) {
                roots
                    .add(cert.context("parsing the request-header CA")?)
                    .context("adding the request-header CA")?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            )
            .allow_unauthenticated()
            .build()
            .context("building the client certificate verifier")?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .context("the serving certificate does not match its key")?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}
