//! The choices a caller makes of how a prefill runs, as a plan's options (Python's
//! `PrefillPlan(..., kv_splits=, cta_pairs=, cuda_form=, cpu_isa=)`, the C ABI's
//! `MlxnRunOptions`): the plan records them on each dispatch ([`crate::interface::Dispatch`]'s
//! `options`) and the backend that runs it reads them. An option left unset is the library's
//! default, which an environment variable may override ([`crate::settings`], read once); a
//! value the caller gives wins over both. Each option's names are parsed here, once, for
//! the settings, the C ABI and the process-wide switches alike.
//!
//! A leaf: it imports nothing of the library.

/// Which CTA-pair forms (Hopper: two CTAs of a cluster share each K/V tile) may run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CtaPairs {
    /// Head pairs where the group of query heads splits in two, else query pairs.
    Auto,
    /// The one-CTA forms only.
    Off,
    /// Query pairs only.
    Queries,
}

impl CtaPairs {
    /// The names [`CtaPairs::parse`] takes, for messages.
    pub const NAMES: &'static str = "'auto', 'off' or 'queries'";

    /// `auto`, `off`, `queries`; also `1` and `0`, the environment variable's older names.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "auto" | "1" => Some(CtaPairs::Auto),
            "off" | "0" => Some(CtaPairs::Off),
            "queries" => Some(CtaPairs::Queries),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            CtaPairs::Auto => "auto",
            CtaPairs::Off => "off",
            CtaPairs::Queries => "queries",
        }
    }
}

/// Which form of the CUDA kernels runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaForm {
    /// The device's own: the Hopper (sm_90a, wgmma) form on Hopper GPUs, else the portable.
    Auto,
    /// The portable (mma.sync) form, built for the device's plain architecture (`sm_90` on
    /// a Hopper GPU), wherever it runs.
    Portable,
}

impl CudaForm {
    pub const NAMES: &'static str = "'auto' or 'portable'";

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "auto" => Some(CudaForm::Auto),
            "portable" => Some(CudaForm::Portable),
            _ => None,
        }
    }
}

/// Most parts a walk over the cache is cut into (the merge reads each part's lse per row).
pub const MAX_KV_SPLITS: u32 = 16;

/// Whether `n` is a number of KV splits: 0 or 1 (never split) or a power of two up to
/// [`MAX_KV_SPLITS`].
pub fn kv_splits_ok(n: u32) -> bool {
    n <= 1 || (n.is_power_of_two() && n <= MAX_KV_SPLITS)
}

/// The options of one plan; `None` everywhere (the default) is the library's own choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RunOptions {
    /// CUDA: the parts each CTA's walk over the cache is cut into; `Some(0 | 1)` never
    /// splits, `Some(n)` always `n` parts where the launch can take them; `None`: the shape
    /// decides.
    pub kv_splits: Option<u32>,
    /// CUDA (Hopper form): which CTA-pair forms may run.
    pub cta_pairs: Option<CtaPairs>,
    /// CUDA: which form of the kernels runs.
    pub cuda_form: Option<CudaForm>,
    /// CPU: the instruction set of the kernels (a name the CPU backend offers, checked
    /// there when the options are made).
    pub cpu_isa: Option<&'static str>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every name parses back to what it names; a name not listed is refused.
    #[test]
    fn names_parse_and_others_are_refused() {
        for p in [CtaPairs::Auto, CtaPairs::Off, CtaPairs::Queries] {
            assert_eq!(CtaPairs::parse(p.name()), Some(p));
            assert!(CtaPairs::NAMES.contains(p.name()));
        }
        assert_eq!(CtaPairs::parse("0"), Some(CtaPairs::Off));
        assert_eq!(CtaPairs::parse("1"), Some(CtaPairs::Auto));
        assert_eq!(CtaPairs::parse("heads"), None);
        assert_eq!(CudaForm::parse("portable"), Some(CudaForm::Portable));
        assert_eq!(CudaForm::parse("sm_90"), None);
        let ok: Vec<u32> = (0..=32).filter(|&n| kv_splits_ok(n)).collect();
        assert_eq!(ok, vec![0, 1, 2, 4, 8, 16]);
    }
}
