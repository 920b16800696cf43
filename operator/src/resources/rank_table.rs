//! Builds the HCCL rank table (`hccl.json`) of one replica group from its pods, in the
//! contract's format ([`npufleet_contract::rank_table`]): `status` stays `initializing` until
//! every rank's pod is known.

use k8s_openapi::api::core::v1::Pod;
use npufleet_contract::rank_table::{DeviceEntry, Document, ServerEntry};
use serde::Deserialize;

use crate::labels::ASCEND_910_CONFIGURATION;

/// The device plugin's `ascend-910-configuration` annotation (only the fields used here).
#[derive(Deserialize, Debug)]
struct DeviceAllocation {
    #[serde(default)]
    server_id: Option<serde_json::Value>,
    #[serde(default)]
    host_ip: Option<String>,
    #[serde(default)]
    devices: Vec<AllocatedDevice>,
}

#[derive(Deserialize, Debug)]
struct AllocatedDevice {
    device_id: serde_json::Value,
    device_ip: String,
}

fn as_text(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Builds the rank table of a group from its pods, in rank order (`ranks[i]` is the pod of rank
/// `i`, `None` while it does not exist). A rank is known once its pod has a pod IP; device ids and IPs come from the device plugin's annotation when present, else the
/// devices are numbered from 0 and reached at the pod IP.
pub fn build(ranks: &[Option<&Pod>], devices_per_pod: i32) -> Document {
    let server_list = ranks
        .iter()
        .enumerate()
        .filter_map(|(rank_index, pod)| server_of((*pod)?, rank_index, devices_per_pod))
        .collect();
    Document::new(server_list, ranks.len())
}

fn server_of(pod: &Pod, rank_index: usize, devices_per_pod: i32) -> Option<ServerEntry> {
    let status = pod.status.as_ref()?;
    let container_ip = status.pod_ip.clone().filter(|ip| !ip.is_empty())?;
    let allocation = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ASCEND_910_CONFIGURATION))
        .and_then(|json| serde_json::from_str::<DeviceAllocation>(json).ok());
    let host_ip = allocation
        .as_ref()
        .and_then(|a| a.host_ip.clone())
        .or_else(|| status.host_ip.clone())
        .filter(|ip| !ip.is_empty())
        .unwrap_or_else(|| container_ip.clone());
    let server_id = allocation
        .as_ref()
        .and_then(|a| a.server_id.as_ref().map(as_text))
        .unwrap_or_else(|| host_ip.clone());
    let devices: Vec<(String, String)> = match allocation {
        Some(a) if !a.devices.is_empty() => a
            .devices
            .iter()
            .map(|d| (as_text(&d.device_id), d.device_ip.clone()))
            .collect(),
        _ => (0..devices_per_pod)
            .map(|i| (i.to_string(), container_ip.clone()))
            .collect(),
    };
    let first_rank = rank_index * devices.len();
    let device = devices
        .into_iter()
        .enumerate()
        .map(|(i, (device_id, device_ip))| DeviceEntry {
            device_id,
            device_ip,
            rank_id: (first_rank + i).to_string(),
        })
        .collect();
    Some(ServerEntry {
        server_id,
        host_ip: Some(host_ip),
        container_ip: Some(container_ip),
        device,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::PodStatus;
    use kube::api::ObjectMeta;

    fn pod(pod_ip: Option<&str>, host_ip: &str, annotation: Option<&str>) -> Pod {
        Pod {
            metadata: ObjectMeta {
                annotations: annotation
                    .map(|a| [(ASCEND_910_CONFIGURATION.to_string(), a.to_string())].into()),
                ..Default::default()
            },
            status: Some(PodStatus {
                pod_ip: pod_ip.map(str::to_string),
                host_ip: Some(host_ip.to_string()),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn matches_the_documented_version_1_0_document() {
        let annotation = r#"{"pod_name":"w-0-0","server_id":"10.0.0.11","host_ip":"10.0.0.11",
            "super_pod_id":"-1","devices":[{"device_id":"0","device_ip":"192.168.101.1"},
            {"device_id":"1","device_ip":"192.168.101.2"}]}"#;
        let p = pod(Some("172.16.0.5"), "10.0.0.11", Some(annotation));
        let table = build(&[Some(&p)], 2);
        let expected = serde_json::json!({"status": "completed", "version": "1.0", "server_count": "1",
            "server_list": [
              {"server_id": "10.0.0.11", "host_ip": "10.0.0.11", "container_ip": "172.16.0.5",
               "device": [{"device_id": "0", "device_ip": "192.168.101.1", "rank_id": "0"},
                          {"device_id": "1", "device_ip": "192.168.101.2", "rank_id": "1"}]}]});
        assert_eq!(serde_json::to_value(&table).unwrap(), expected);
        let text = serde_json::to_string(&table).unwrap();
        assert!(text.starts_with(
            r#"{"status":"completed","version":"1.0","server_count":"1","server_list""#
        ));
    }

    #[test]
    fn rank_ids_follow_rank_index_times_devices_per_pod() {
        let a = pod(Some("172.16.0.5"), "10.0.0.11", None);
        let b = pod(Some("172.16.0.6"), "10.0.0.12", None);
        let table = build(&[Some(&a), Some(&b)], 2);
        let ranks: Vec<(&str, &str, &str)> = table
            .server_list
            .iter()
            .flat_map(|s| {
                s.device.iter().map(|d| {
                    (
                        d.device_id.as_str(),
                        d.device_ip.as_str(),
                        d.rank_id.as_str(),
                    )
                })
            })
            .collect();
        assert_eq!(
            ranks,
            [
                ("0", "172.16.0.5", "0"),
                ("1", "172.16.0.5", "1"),
                ("0", "172.16.0.6", "2"),
                ("1", "172.16.0.6", "3")
            ]
        );
        assert_eq!(
            table.server_list[1].server_id, "10.0.0.12",
            "server id falls back to the host IP"
        );
        assert_eq!(table.status, "completed");
        assert_eq!(table.server_count, "2");
    }

    #[test]
    fn stays_initializing_until_every_rank_is_known() {
        let known = pod(Some("172.16.0.5"), "10.0.0.11", None);
        let without_ip = pod(None, "10.0.0.12", None);
        assert_eq!(build(&[Some(&known), None], 1).status, "initializing");
        let partial = build(&[Some(&known), Some(&without_ip)], 1);
        assert_eq!(partial.status, "initializing");
        assert_eq!(partial.server_count, "1");
    }

    #[test]
    fn numeric_device_ids_in_the_annotation_become_strings() {
        let annotation = r#"{"server_id":7,"devices":[{"device_id":3,"device_ip":"192.168.1.4"}]}"#;
        let p = pod(Some("172.16.0.5"), "10.0.0.11", Some(annotation));
        let table = build(&[Some(&p)], 1);
        let server = &table.server_list[0];
        assert_eq!(server.server_id, "7");
        assert_eq!(server.host_ip.as_deref(), Some("10.0.0.11"));
        assert_eq!(server.device[0].device_id, "3");
    }
}
