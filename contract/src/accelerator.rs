//! Accelerator families an InferenceService can name, and how the worker is told which one
//! its pod has.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum AcceleratorType {
    Ascend910,
    Ascend310p,
    Cpu,
}

impl AcceleratorType {
    pub const ALL: [AcceleratorType; 3] = [Self::Ascend910, Self::Ascend310p, Self::Cpu];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ascend910 => "ascend910",
            Self::Ascend310p => "ascend310p",
            Self::Cpu => "cpu",
        }
    }

    pub fn is_npu(self) -> bool {
        self != Self::Cpu
    }
}

impl fmt::Display for AcceleratorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unknown accelerator {0:?}: expected one of ascend910, ascend310p, cpu")]
pub struct UnknownAccelerator(pub String);

impl FromStr for AcceleratorType {
    type Err = UnknownAccelerator;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let wanted = s.trim().to_ascii_lowercase();
        Self::ALL
            .into_iter()
            .find(|a| a.as_str() == wanted)
            .ok_or_else(|| UnknownAccelerator(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_round_trips_through_text_and_json() {
        for a in AcceleratorType::ALL {
            assert_eq!(a.as_str().parse::<AcceleratorType>(), Ok(a));
            assert_eq!(serde_json::to_value(a).unwrap(), a.as_str());
        }
        assert!(AcceleratorType::Ascend310p.is_npu() && !AcceleratorType::Cpu.is_npu());
        assert!("gpu".parse::<AcceleratorType>().is_err());
    }
}
