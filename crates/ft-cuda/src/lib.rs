//! ft-cuda: the GPU side of FreeToken, reached through `libfreetoken_cuda.so` (built by
//! `cuda/CMakeLists.txt`), which this crate loads at run time.
//!
//! The library is found through `FREETOKEN_CUDA_LIB` (a file, or a folder holding it), else
//! next to the module this code is linked into (the `_core` extension), and opened with
//! `RTLD_LOCAL`: it carries its own ggml-base, which must not interpose with the extension's.
//! Its C ABI is checked on load (ABI version, the size of every argument struct) and every
//! call's arguments are checked here before the library sees them (shapes, sizes, the
//! 2^31-block limit, slot ids). Without the library or without a GPU, [`runtime`] says why and
//! FreeToken runs CPU-only.
//!
//! Device memory is the caller's (torch tensors): addresses cross as `usize`, and the work is
//! queued on the caller's stream.

mod abi;
mod checks;
mod loader;
mod ops;

pub use abi::{
    fetch_words, ABI_VERSION, ATTN_MAX_KEYS, FETCHED, FETCH_MAX_EXPERTS, FETCH_STATS, GDN_MAX_DIM,
    GDN_MAX_SEQS, TOPK_MAX_EXPERTS, TOPK_MAX_K,
};
pub use checks::check_ids;
pub use ft_core::cache_plan::{pool_nbytes, MAX_POOL_BLOCKS as MAX_BLOCKS, ROW_PADDING};
pub use loader::{available, library_present, runtime, Cuda, LIB_ENV, LIB_NAME};
pub use ops::{
    Activation, AttnDecode, AttnDecodeShape, DeviceInfo, ExpertMatmul, FetchGather, FetchKind,
    FetchLinks, FetchPlan, GdnDecode, Handoff, HandoffRoutes, Kernel, MoeLayer, NormRope,
    TopkSoftmax, MMVQ_MAX_TOKENS,
};
