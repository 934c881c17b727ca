//! The QPL path choice, which exists whether or not the `qpl` feature is on
//! (the engine's configuration names it).

use std::fmt;
use std::str::FromStr;

use super::error::CodecError;

/// `qpl_path_t`: which QPL implementation runs the jobs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum QplPath {
    /// Hardware when present, else QPL's software path.
    #[default]
    Auto,
    /// IAA only; initialisation fails without a usable device.
    Hardware,
    /// QPL's software implementation (for testing the path without IAA).
    Software,
}

impl QplPath {
    /// Short lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            QplPath::Auto => "auto",
            QplPath::Hardware => "hardware",
            QplPath::Software => "software",
        }
    }
}

impl fmt::Display for QplPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for QplPath {
    type Err = CodecError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(QplPath::Auto),
            "hardware" | "hw" => Ok(QplPath::Hardware),
            "software" | "sw" => Ok(QplPath::Software),
            _ => Err(CodecError::QplUnsupported(format!(
                "unknown QPL path {s:?} (auto, hardware or software)"
            ))),
        }
    }
}
