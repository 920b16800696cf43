//! The precision policies a worker runs with, named once for the CRD, the operator, the worker's
//! CLI and its benchmark.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Under [`Precision::Auto`], prompts up to this many tokens run at int8, longer ones at full
/// precision. By default no prompt is longer: with two weight groups per 512-bit
/// multiply-add, int8 prefill measured faster than full precision at every length tried
/// (1.7× at 2000 tokens and 1.4× at 4000 on SmolLM2 `Q4_K_M`, 2 cores), so a lower limit
/// only serves a deployment that wants long prompts at full precision.
pub const AUTO_INT8_MAX_PROMPT_TOKENS: usize = usize::MAX;

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// int8 weights and activations.
    Int8,
    /// f32 weights and arithmetic.
    Fp32,
    /// f16 weights, f32 arithmetic.
    Fp16,
    /// int8 for prompts up to [`AUTO_INT8_MAX_PROMPT_TOKENS`] (or the worker's override) and
    /// decode; full precision for longer prompts.
    #[default]
    Auto,
}

impl Precision {
    pub const ALL: [Precision; 4] = [Self::Int8, Self::Fp32, Self::Fp16, Self::Auto];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Int8 => "int8",
            Self::Fp32 => "fp32",
            Self::Fp16 => "fp16",
            Self::Auto => "auto",
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unknown precision {0:?}: expected one of int8, fp32, fp16, auto")]
pub struct UnknownPrecision(pub String);

impl FromStr for Precision {
    type Err = UnknownPrecision;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let wanted = s.trim().to_ascii_lowercase();
        Self::ALL
            .into_iter()
            .find(|p| p.as_str() == wanted)
            .ok_or_else(|| UnknownPrecision(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_round_trips_through_text_and_json() {
        for p in Precision::ALL {
            assert_eq!(p.as_str().parse::<Precision>(), Ok(p));
            assert_eq!(serde_json::to_value(p).unwrap(), p.as_str());
        }
        assert_eq!(" INT8 ".parse::<Precision>(), Ok(Precision::Int8));
        let err = "bf16".parse::<Precision>().unwrap_err().to_string();
        assert!(err.contains("\"bf16\"") && err.contains("fp32"), "{err}");
        assert_eq!(Precision::default(), Precision::Auto);
    }
}
