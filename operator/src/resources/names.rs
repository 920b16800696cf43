//! Names of the objects made for an InferenceService.
//!
//! An InferenceService name is a DNS-1123 subdomain (`qwen2.5-0.5b`, `7b-chat`), but a Service
//! name must be a DNS-1035 label and a pod's hostname a DNS-1123 label. Every derived name is
//! built on [`base`], which is the InferenceService name when that is already a DNS-1035 label
//! and otherwise a DNS-1035 transform of it with a short hash of the original, so two
//! InferenceServices never share a base.

use kube::ResourceExt;
use npufleet_crds::InferenceService;

/// Prefix for names that start with a digit (a DNS-1035 label starts with a letter).
const DIGIT_PREFIX: &str = "isvc-";
/// Hex digits of the hash appended to a transformed name.
const HASH_DIGITS: usize = 5;

fn is_dns1035_label(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes[0].is_ascii_lowercase()
        && bytes[bytes.len() - 1] != b'-'
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
}

/// FNV-1a, stable across Rust releases (the standard hasher is not).
fn fnv1a(text: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in text.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// The DNS-1035 label every derived name starts with: `name` itself when it already is one,
/// else `name` with each character outside `[a-z0-9-]` replaced by `-`, prefixed when it
/// starts with a digit, and suffixed with a hash of `name`.
pub fn base_of(name: &str) -> String {
    if is_dns1035_label(name) {
        return name.to_string();
    }
    let mut label: String = name
        .chars()
        .map(|c| match c {
            'a'..='z' | '0'..='9' | '-' => c,
            'A'..='Z' => c.to_ascii_lowercase(),
            _ => '-',
        })
        .collect();
    if !label.starts_with(|c: char| c.is_ascii_lowercase()) {
        label.insert_str(0, DIGIT_PREFIX);
    }
    let hash = format!("{:016x}", fnv1a(name));
    format!("{}-{}", label.trim_end_matches('-'), &hash[..HASH_DIGITS])
}

pub fn base(isvc: &InferenceService) -> String {
    base_of(&isvc.name_any())
}

/// Replica group `group`: also its Volcano PodGroup's name.
pub fn group(isvc: &InferenceService, group: i32) -> String {
    format!("{}-{group}", base(isvc))
}

/// Also the pod's hostname, so a DNS-1123 label.
pub fn pod(isvc: &InferenceService, group: i32, rank: i32) -> String {
    format!("{}-{group}-{rank}", base(isvc))
}

/// ascend-operator's name for a job's rank table, the job here being one replica group.
pub fn rank_table(isvc: &InferenceService, group: i32) -> String {
    format!("rings-config-{}-{group}", base(isvc))
}

/// Rank discovery: `<pod>.<base>-ranks.<namespace>.svc`.
pub fn headless_service(isvc: &InferenceService) -> String {
    format!("{}-ranks", base(isvc))
}

pub fn client_service(isvc: &InferenceService) -> String {
    base(isvc)
}

pub fn disruption_budget(isvc: &InferenceService) -> String {
    base(isvc)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The longest InferenceService name the CRD admits.
    const MAX_NAME: usize = 40;

    fn is_dns1123_label(name: &str) -> bool {
        let bytes = name.as_bytes();
        !bytes.is_empty()
            && bytes.len() <= 63
            && bytes[0].is_ascii_alphanumeric()
            && bytes[bytes.len() - 1].is_ascii_alphanumeric()
            && bytes
                .iter()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
    }

    #[test]
    fn dns_1035_names_are_kept_as_they_are() {
        for name in ["llm", "smollm2", "deepseek-13b", "a"] {
            assert_eq!(base_of(name), name);
        }
    }

    #[test]
    fn model_like_names_become_valid_labels_with_a_hash() {
        let dotted = base_of("qwen2.5-0.5b");
        assert!(dotted.starts_with("qwen2-5-0-5b-"), "{dotted}");
        let digit = base_of("7b-chat");
        assert!(digit.starts_with("isvc-7b-chat-"), "{digit}");
        assert!(is_dns1035_label(&dotted) && is_dns1035_label(&digit));
        assert_ne!(
            base_of("qwen2.5-0.5b"),
            base_of("qwen2-5-0-5b"),
            "a transformed name never equals the name it resembles"
        );
        assert_ne!(base_of("a.b"), base_of("a..b"));
        assert_eq!(base_of("qwen2.5-0.5b"), dotted, "stable");
    }

    #[test]
    fn every_derived_name_is_valid_for_its_kind_at_the_longest_names() {
        let names = [
            "a".repeat(MAX_NAME),
            format!("7{}", "b".repeat(MAX_NAME - 1)),
            format!("{}.x", "q".repeat(MAX_NAME - 2)),
            "0".repeat(MAX_NAME),
            format!("a{}", ".b".repeat((MAX_NAME - 1) / 2)),
        ];
        for name in names {
            let base = base_of(&name);
            assert!(is_dns1035_label(&base), "{name} -> {base}");
            // Services: DNS-1035 labels.
            assert!(is_dns1035_label(&format!("{base}-ranks")), "{name}");
            // Pods: the hostname is the pod name, a DNS-1123 label, for the largest group
            // (replicas <= 1000) and rank (tensor <= 64).
            assert!(is_dns1123_label(&format!("{base}-999-63")), "{name}");
            // ConfigMaps: DNS-1123 subdomains.
            assert!(format!("rings-config-{base}-999").len() <= 253, "{name}");
        }
    }
}
