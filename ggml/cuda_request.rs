//! The install's GPU option, checked before anything is compiled: `FREETOKEN_CUDA=1` asks for
//! libfreetoken_cuda.so (built by crates/ft-cuda/build.rs through cuda/CMakeLists.txt),
//! `FREETOKEN_CUDA_ARCHS` names its CUDA architectures (default `native`). A request that
//! cannot be met stops the build here with one line, minutes before the CUDA compile would.

use std::env;
use std::path::{Path, PathBuf};

/// What the GPU build needs: the CUDA compiler and the architectures, as CMake spells them.
pub struct CudaRequest {
    pub nvcc: PathBuf,
    pub archs: String,
}

/// The request in the environment: None when the GPU library is not asked for.
pub fn from_env() -> Result<Option<CudaRequest>, String> {
    for var in [
        "FREETOKEN_CUDA",
        "FREETOKEN_CUDA_ARCHS",
        "CUDACXX",
        "CUDA_HOME",
        "CUDA_PATH",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let flag = env::var("FREETOKEN_CUDA").unwrap_or_default();
    match flag.trim().to_ascii_lowercase().as_str() {
        "" | "0" | "off" | "false" | "no" => return Ok(None),
        "1" | "on" | "true" | "yes" => {}
        other => {
            return Err(format!(
                "FREETOKEN_CUDA={other}: use 1 to build the GPU library, 0 (or unset) not to"
            ))
        }
    }
    let archs = archs(&env::var("FREETOKEN_CUDA_ARCHS").unwrap_or_default())?;
    let nvcc = find_nvcc().ok_or(
        "FREETOKEN_CUDA=1 needs the CUDA toolkit's compiler nvcc: none on PATH, in CUDACXX, \
         CUDA_HOME, CUDA_PATH or /usr/local/cuda (install the CUDA toolkit, or unset \
         FREETOKEN_CUDA for a CPU-only build)",
    )?;
    Ok(Some(CudaRequest { nvcc, archs }))
}

/// `FREETOKEN_CUDA_ARCHS` as CMAKE_CUDA_ARCHITECTURES: `native` (the default), `all`,
/// `all-major`, or a list (`;`, `,` or spaces) of compute capabilities such as `86`, `90a`,
/// `89-real`, `90-virtual`.
pub fn archs(value: &str) -> Result<String, String> {
    let value = value.trim();
    if value.is_empty() {
        return Ok("native".into());
    }
    if matches!(value, "native" | "all" | "all-major") {
        return Ok(value.into());
    }
    let items: Vec<&str> = value
        .split([';', ',', ' '])
        .filter(|s| !s.is_empty())
        .collect();
    for item in &items {
        let cc = item
            .strip_suffix("-real")
            .or_else(|| item.strip_suffix("-virtual"))
            .unwrap_or(item);
        let digits = cc.trim_end_matches(|c: char| c.is_ascii_lowercase());
        let suffix = &cc[digits.len()..];
        let ok = (2..=3).contains(&digits.len())
            && digits.bytes().all(|b| b.is_ascii_digit())
            && suffix.len() <= 1;
        if !ok {
            return Err(format!(
                "FREETOKEN_CUDA_ARCHS={value}: `{item}` is not a CUDA architecture (use native, \
                 all, all-major or compute capabilities such as 86;89;90a)"
            ));
        }
    }
    Ok(items.join(";"))
}

fn find_nvcc() -> Option<PathBuf> {
    if let Some(p) = env::var_os("CUDACXX") {
        let p = PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    let on_path = env::var_os("PATH")
        .into_iter()
        .flat_map(|p| env::split_paths(&p).collect::<Vec<_>>());
    let homes = ["CUDA_HOME", "CUDA_PATH"]
        .into_iter()
        .filter_map(env::var_os)
        .map(|h| Path::new(&h).join("bin"))
        .chain([PathBuf::from("/usr/local/cuda/bin")]);
    on_path
        .chain(homes)
        .map(|dir| dir.join("nvcc"))
        .find(|p| p.is_file())
}
