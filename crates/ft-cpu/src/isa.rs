//! The instruction sets the CPU kernels dispatch on, and the cap `FREETOKEN_CPU_ISA` that
//! picks a lower one, so that every path can be tested and measured on any host.
//!
//! The cap chooses among our own kernels only: ggml's row kernels, which take the types and
//! the tails ours do not, are compiled for the build's CPU options whatever the cap.

use freetoken_ggml::{Error, Result};
use std::sync::OnceLock;

/// The environment variable that caps the instruction set.
pub const ISA_VAR: &str = "FREETOKEN_CPU_ISA";

/// A level of the CPU kernels, lowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum CpuIsa {
    /// ggml's row kernels only, one call per row.
    Generic,
    /// Our multi-row kernels for AVX2, FMA and F16C.
    Avx2,
    /// Our multi-row kernels for AVX-512 F/BW/VL with VNNI.
    Avx512,
}

impl CpuIsa {
    /// Every level, lowest first.
    pub const ALL: [CpuIsa; 3] = [CpuIsa::Generic, CpuIsa::Avx2, CpuIsa::Avx512];

    /// The level's name, as `FREETOKEN_CPU_ISA` takes it.
    pub fn name(self) -> &'static str {
        match self {
            CpuIsa::Generic => "generic",
            CpuIsa::Avx2 => "avx2",
            CpuIsa::Avx512 => "avx512",
        }
    }

    /// Why this host cannot run the level, if it cannot. Our kernels reproduce ggml's AVX2
    /// dot products bit for bit, so they also need a ggml compiled with AVX2 (whose row
    /// kernels round otherwise).
    pub fn missing(self) -> Option<&'static str> {
        if self == CpuIsa::Generic {
            return None;
        }
        #[cfg(target_arch = "x86_64")]
        {
            if !(is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c"))
            {
                return Some("the CPU lacks AVX2, FMA or F16C");
            }
            if !freetoken_ggml::cpu_has_avx2() {
                return Some("ggml was built without AVX2");
            }
            if self == CpuIsa::Avx512
                && !(is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni"))
            {
                return Some("the CPU lacks AVX-512 F/BW/VL with VNNI");
            }
            None
        }
        #[cfg(not(target_arch = "x86_64"))]
        Some("the CPU is not x86-64")
    }

    /// The highest level this host runs.
    pub fn best() -> CpuIsa {
        CpuIsa::ALL
            .into_iter()
            .rev()
            .find(|l| l.missing().is_none())
            .unwrap_or(CpuIsa::Generic)
    }

    /// The level a cap names (empty: the best): an unknown name, or a level this host
    /// cannot run, is an error.
    pub fn parse(cap: &str) -> Result<CpuIsa> {
        let cap = cap.trim();
        if cap.is_empty() {
            return Ok(CpuIsa::best());
        }
        let names: Vec<&str> = CpuIsa::ALL.iter().map(|l| l.name()).collect();
        let level = CpuIsa::ALL
            .into_iter()
            .find(|l| l.name().eq_ignore_ascii_case(cap))
            .ok_or_else(|| {
                Error::InvalidInput(format!(
                    "{ISA_VAR}={cap}: not a CPU kernel level (one of {})",
                    names.join(", ")
                ))
            })?;
        match level.missing() {
            Some(why) => Err(Error::Unsupported(format!(
                "{ISA_VAR}={cap}: this host cannot run it ({why}); it runs {}",
                CpuIsa::best().name()
            ))),
            None => Ok(level),
        }
    }
}

/// The level in use: `FREETOKEN_CPU_ISA`'s, or the best this host runs; read once.
pub fn cpu_isa() -> Result<CpuIsa> {
    static LEVEL: OnceLock<Result<CpuIsa>> = OnceLock::new();
    LEVEL
        .get_or_init(|| match std::env::var(ISA_VAR) {
            Ok(cap) => CpuIsa::parse(&cap),
            Err(std::env::VarError::NotPresent) => Ok(CpuIsa::best()),
            Err(std::env::VarError::NotUnicode(v)) => Err(Error::InvalidInput(format!(
                "{ISA_VAR}={v:?}: not a CPU kernel level"
            ))),
        })
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_and_unrunnable_caps_are_errors() {
        let e = CpuIsa::parse("sse9").unwrap_err();
        assert!(matches!(e, Error::InvalidInput(_)), "{e:?}");
        assert!(e.message().contains("avx2"), "{e}");
        for level in CpuIsa::ALL {
            let got = CpuIsa::parse(&level.name().to_uppercase());
            match level.missing() {
                None => assert_eq!(got, Ok(level)),
                Some(_) => assert!(matches!(got, Err(Error::Unsupported(_))), "{got:?}"),
            }
        }
        assert_eq!(CpuIsa::parse(" "), Ok(CpuIsa::best()));
        assert_eq!(CpuIsa::Generic.missing(), None);
    }
}
