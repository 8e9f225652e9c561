//! Builds libfreetoken_cuda.so through cuda/CMakeLists.txt when the install asks for it
//! (`FREETOKEN_CUDA=1`, checked by ggml/build.rs, which passes the request on as DEP_GGML_*),
//! from the same pinned tree and CPU options as the extension's ggml, and puts it in
//! python/freetoken/ where the wheel takes it (pyproject.toml) and the loader looks for it.
//! Without the request nothing is built and nothing there is touched.

use std::env;
use std::fs;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=../../cuda");
    let (Ok(nvcc), Ok(archs)) = (
        env::var("DEP_GGML_CUDA_NVCC"),
        env::var("DEP_GGML_CUDA_ARCHS"),
    ) else {
        return;
    };
    let src = env::var("DEP_GGML_SRC").expect("freetoken-ggml passes its source tree");
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").unwrap());
    let root = manifest.join("../..");
    println!(
        "cargo:warning=building libfreetoken_cuda.so for CUDA architectures {archs} \
         (ggml-cuda: about 15 minutes per architecture on 2 cores)"
    );
    let mut cfg = cmake::Config::new(root.join("cuda"));
    cfg.profile("Release")
        .define("FREETOKEN_LLAMA_SRC", &src)
        .define("FREETOKEN_CUDA_ARCHS", &archs)
        .define("CMAKE_CUDA_COMPILER", &nvcc)
        .build_target("freetoken_cuda");
    for opt in env::var("DEP_GGML_CPU_OPTIONS")
        .unwrap_or_default()
        .split(';')
    {
        if let Some((name, value)) = opt.split_once('=') {
            cfg.define(name, value);
        }
    }
    let lib = cfg.build().join("build").join("libfreetoken_cuda.so");
    let dest = root.join("python/freetoken/libfreetoken_cuda.so");
    fs::copy(&lib, &dest)
        .unwrap_or_else(|e| panic!("copying {} to {}: {e}", lib.display(), dest.display()));
}
