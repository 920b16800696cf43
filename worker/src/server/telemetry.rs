//! Accelerator telemetry: Linux thermal zones, and on Ascend hosts the chip readings of
//! `npu-smi info`, exported under the names Huawei's npu-exporter uses.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// One readable thermal zone.
#[derive(Debug, Clone, PartialEq)]
pub struct ThermalZone {
    /// Directory name, for example `thermal_zone0`.
    pub zone: String,
    /// Contents of the zone's `type` file, for example `x86_pkg_temp`.
    pub kind: String,
    pub celsius: f64,
}

/// Reads every `thermal_zone*` under `root` (normally `/sys/class/thermal`) whose `temp`
/// is readable; zones that cannot be read are skipped.
pub fn read_thermal_zones(root: &Path) -> Vec<ThermalZone> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut zones: Vec<ThermalZone> = entries
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let zone = entry.file_name().to_str()?.to_string();
            if !zone.starts_with("thermal_zone") {
                return None;
            }
            let millidegrees: f64 = std::fs::read_to_string(entry.path().join("temp"))
                .ok()?
                .trim()
                .parse()
                .ok()?;
            let kind = std::fs::read_to_string(entry.path().join("type"))
                .map(|s| s.trim().to_string())
                .unwrap_or_default();
            Some(ThermalZone {
                zone,
                kind,
                celsius: millidegrees / 1000.0,
            })
        })
        .collect();
    zones.sort_by(|a, b| a.zone.cmp(&b.zone));
    zones
}

/// One chip as `npu-smi info` reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct NpuChip {
    pub npu_id: u32,
    pub chip_id: u32,
    /// Chip model, for example `910B3` or `310P3`.
    pub name: String,
    pub healthy: bool,
    /// `None` where the tool prints `NA`.
    pub power_watts: Option<f64>,
    pub temperature_celsius: f64,
    pub aicore_percent: f64,
    /// Device memory in MB: HBM where the chip has it, otherwise the on-card memory.
    pub memory_used_mb: f64,
    pub memory_total_mb: f64,
}

/// Parses the chip table of `npu-smi info`.
///
/// Each chip takes two table rows:
/// `| 0     910B3 | OK           | 93.6   40   0    / 0       |` (NPU id and name, health,
/// power, temperature, hugepages) and
/// `| 0           | 0000:C1:00.0 | 0      0    / 0  3161 / 65536 |` (chip id, bus id,
/// AI core usage, then memory used/total pairs, HBM last). The process table that follows is
/// not parsed.
pub fn parse_npu_smi_info(output: &str) -> Vec<NpuChip> {
    let mut chips = Vec::new();
    let mut pending: Option<(u32, String, bool, Option<f64>, f64)> = None;
    for line in output.lines() {
        if line.contains("Process id") || line.contains("Process name") {
            break;
        }
        let trimmed = line.trim();
        if !trimmed.starts_with('|') {
            pending = None;
            continue;
        }
        let cells: Vec<&str> = trimmed
            .trim_matches('|')
            .split('|')
            .map(str::trim)
            .collect();
        let [first, second, third] = cells.as_slice() else {
            continue;
        };
        let first_words: Vec<&str> = first.split_whitespace().collect();
        let Some(id) = first_words.first().and_then(|w| w.parse::<u32>().ok()) else {
            pending = None;
            continue;
        };
        match pending.take() {
            None => {
                let Some(name) = first_words.get(1) else {
                    continue;
                };
                let numbers: Vec<&str> = third.split_whitespace().collect();
                let (Some(power), Some(temperature)) = (numbers.first(), numbers.get(1)) else {
                    continue;
                };
                let Ok(temperature) = temperature.parse::<f64>() else {
                    continue;
                };
                pending = Some((
                    id,
                    name.to_string(),
                    second.eq_ignore_ascii_case("OK"),
                    power.parse().ok(),
                    temperature,
                ));
            }
            Some((npu_id, name, healthy, power_watts, temperature_celsius)) => {
                let Some((aicore_percent, memory)) = parse_usage_cell(third) else {
                    continue;
                };
                let Some(&(memory_used_mb, memory_total_mb)) = memory.last() else {
                    continue;
                };
                chips.push(NpuChip {
                    npu_id,
                    chip_id: id,
                    name,
                    healthy,
                    power_watts,
                    temperature_celsius,
                    aicore_percent,
                    memory_used_mb,
                    memory_total_mb,
                });
            }
        }
    }
    chips
}

/// Splits `0   0 / 0   3161 / 65536` into the AI core percentage and the `used / total` pairs.
fn parse_usage_cell(cell: &str) -> Option<(f64, Vec<(f64, f64)>)> {
    let (aicore, rest) = cell.trim().split_once(char::is_whitespace)?;
    let aicore = aicore.parse().ok()?;
    let numbers: Vec<f64> = rest
        .split(|c: char| c == '/' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    if numbers.is_empty() || !numbers.len().is_multiple_of(2) {
        return None;
    }
    Some((
        aicore,
        numbers.chunks_exact(2).map(|p| (p[0], p[1])).collect(),
    ))
}

/// Where `npu-smi` is on `PATH`, if anywhere.
pub fn find_npu_smi() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join("npu-smi"))
        .find(|candidate| candidate.is_file())
}

/// Runs `npu-smi info` and parses it; `None` if the tool fails or hangs.
pub async fn sample_npu_smi(tool: &Path) -> Option<Vec<NpuChip>> {
    let run = tokio::process::Command::new(tool)
        .arg("info")
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .ok()?
        .ok()?;
    if !output.status.success() {
        return None;
    }
    Some(parse_npu_smi_info(&String::from_utf8_lossy(&output.stdout)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ATLAS_800T_A2: &str = "\
+------------------------------------------------------------------------------------------------+
| npu-smi 23.0.6                   Version: 23.0.6                                               |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 93.6        40                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3161 / 65536         |
+===========================+===============+====================================================+
| 1     910B3               | Warning       | 88.1        43                0    / 0             |
| 0                         | 0000:C2:00.0  | 12          0    / 0          40321/ 65536         |
+===========================+===============+====================================================+
+---------------------------+---------------+----------------------------------------------------+
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
+===========================+===============+====================================================+
| 0       0                 | 2412          | python3                  | 3100                    |
+===========================+===============+====================================================+
";

    const ATLAS_300I_PRO: &str = "\
+--------------------------------------------------------------------------------------------------------+
| npu-smi 23.0.0                                   Version: 23.0.0                                       |
+-------------------------------+-----------------+------------------------------------------------------+
| NPU     Name                  | Health          | Power(W)     Temp(C)           Hugepages-Usage(page) |
| Chip    Device                | Bus-Id          | AICore(%)    Memory-Usage(MB)                        |
+===============================+=================+======================================================+
| 8       310P3                 | OK              | NA           52                0     / 0             |
| 0       0                     | 0000:3B:00.0    | 7            1782 / 21527                            |
+===============================+=================+======================================================+
";

    #[test]
    fn parses_910b_chips_and_stops_at_the_process_table() {
        let chips = parse_npu_smi_info(ATLAS_800T_A2);
        assert_eq!(chips.len(), 2);
        assert_eq!(
            chips[0],
            NpuChip {
                npu_id: 0,
                chip_id: 0,
                name: "910B3".into(),
                healthy: true,
                power_watts: Some(93.6),
                temperature_celsius: 40.0,
                aicore_percent: 0.0,
                memory_used_mb: 3161.0,
                memory_total_mb: 65536.0,
            }
        );
        assert!(!chips[1].healthy);
        assert_eq!(chips[1].aicore_percent, 12.0);
        assert_eq!(chips[1].memory_used_mb, 40321.0);
    }

    #[test]
    fn parses_310p_chips_without_power_or_hbm() {
        let chips = parse_npu_smi_info(ATLAS_300I_PRO);
        assert_eq!(chips.len(), 1);
        assert_eq!(chips[0].npu_id, 8);
        assert_eq!(chips[0].name, "310P3");
        assert_eq!(chips[0].power_watts, None);
        assert_eq!(chips[0].temperature_celsius, 52.0);
        assert_eq!(chips[0].aicore_percent, 7.0);
        assert_eq!(
            (chips[0].memory_used_mb, chips[0].memory_total_mb),
            (1782.0, 21527.0)
        );
    }

    #[test]
    fn unrelated_output_gives_no_chips() {
        assert!(parse_npu_smi_info("").is_empty());
        assert!(parse_npu_smi_info("npu-smi: command failed\n| a | b | c |\n").is_empty());
    }

    #[test]
    fn reads_only_readable_thermal_zones() {
        let root = tempfile::tempdir().unwrap();
        let zone0 = root.path().join("thermal_zone0");
        std::fs::create_dir(&zone0).unwrap();
        std::fs::write(zone0.join("temp"), "45500\n").unwrap();
        std::fs::write(zone0.join("type"), "x86_pkg_temp\n").unwrap();
        let broken = root.path().join("thermal_zone1");
        std::fs::create_dir(&broken).unwrap();
        std::fs::write(broken.join("temp"), "unavailable\n").unwrap();
        std::fs::create_dir(root.path().join("cooling_device0")).unwrap();
        assert_eq!(
            read_thermal_zones(root.path()),
            vec![ThermalZone {
                zone: "thermal_zone0".into(),
                kind: "x86_pkg_temp".into(),
                celsius: 45.5,
            }]
        );
        assert!(read_thermal_zones(&root.path().join("missing")).is_empty());
    }
}
