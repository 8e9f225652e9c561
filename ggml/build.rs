//! Builds ggml-base and ggml-cpu (static) from the pinned llama.cpp source.
//!
//! The source is the `vendor/llama.cpp` tree of the PyPI sdist pinned in
//! `python/freetoken/llama_pin.toml` (name, sha256, URL; Python reads the same file):
//! `FREETOKEN_LLAMA_SRC` may point at an unpacked tree; otherwise the sdist is downloaded
//! (or taken from `FREETOKEN_LLAMA_SDIST`), its sha256 checked, and the tree unpacked into
//! `~/.cache/freetoken/llama.cpp-<sha>` under a file lock, since cargo test, clippy and maturin
//! may run this script at the same time.

use std::env;
use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::LazyLock;

/// The pin file: one `key = "value"` per line (Python reads it as TOML).
const PIN_FILE: &str = "../python/freetoken/llama_pin.toml";

/// The pinned sdist of `PIN_FILE`.
struct Pin {
    name: String,
    sha256: String,
    url: String,
}

static PIN: LazyLock<Pin> = LazyLock::new(|| {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(PIN_FILE);
    println!("cargo:rerun-if-changed={}", path.display());
    let text = fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read the pin {}: {e}", path.display()));
    let value = |key: &str| -> String {
        text.lines()
            .find_map(|line| {
                let (k, v) = line.split_once('=')?;
                (k.trim() == key).then(|| v.trim().trim_matches('"').to_string())
            })
            .unwrap_or_else(|| panic!("{} has no `{key}`", path.display()))
    };
    Pin {
        name: value("name"),
        sha256: value("sha256"),
        url: value("url"),
    }
});

/// Instruction sets of the portable baseline build (`FREETOKEN_CPU_BASELINE=1`).
const BASELINE_OPTIONS: &[&str] = &[
    "GGML_SSE42=ON",
    "GGML_AVX=ON",
    "GGML_AVX2=ON",
    "GGML_FMA=ON",
    "GGML_F16C=ON",
    "GGML_BMI2=ON",
];

mod cuda_request;

type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

fn main() {
    for var in [
        "FREETOKEN_LLAMA_SRC",
        "FREETOKEN_LLAMA_SDIST",
        "FREETOKEN_CACHE",
        "FREETOKEN_CPU_BASELINE",
        "FREETOKEN_GGML_CPU_OPTIONS",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=cuda_request.rs");
    let cuda = cuda_request::from_env().unwrap_or_else(|why| {
        eprintln!("error: {why}");
        std::process::exit(1)
    });
    let llama = llama_source().unwrap_or_else(|e| panic!("freetoken-ggml: {e}"));
    build_ggml(&llama);
    // Other build scripts (the CUDA library, reference builds) find the same tree, the same
    // CPU options and the GPU request here (DEP_GGML_*).
    println!("cargo:src={}", llama.display());
    let options: Vec<String> = cpu_options()
        .iter()
        .map(|(n, v)| format!("{n}={v}"))
        .collect();
    println!("cargo:cpu_options={}", options.join(";"));
    if let Some(cuda) = cuda {
        println!("cargo:cuda_nvcc={}", cuda.nvcc.display());
        println!("cargo:cuda_archs={}", cuda.archs);
    }
}

fn cache_dir() -> PathBuf {
    if let Some(dir) = env::var_os("FREETOKEN_CACHE") {
        return PathBuf::from(dir);
    }
    let home = env::var_os("HOME").expect("HOME is not set");
    PathBuf::from(home).join(".cache").join("freetoken")
}

fn llama_source() -> BoxResult<PathBuf> {
    if let Some(src) = env::var_os("FREETOKEN_LLAMA_SRC") {
        let src = PathBuf::from(src);
        if !src.join("ggml").join("CMakeLists.txt").is_file() {
            return Err(format!(
                "FREETOKEN_LLAMA_SRC={} is not a llama.cpp tree (no ggml/CMakeLists.txt)",
                src.display()
            )
            .into());
        }
        return Ok(src);
    }
    let cache = cache_dir();
    fs::create_dir_all(&cache)?;
    let tree = cache.join(format!("llama.cpp-{}", PIN.sha256));
    let done = tree.join(".freetoken-complete");
    if done.is_file() {
        return Ok(tree);
    }
    let lock = File::create(cache.join(format!("llama.cpp-{}.lock", PIN.sha256)))?;
    lock.lock()?;
    if !done.is_file() {
        let sdist = fetch_sdist(&cache)?;
        unpack_vendor_tree(&sdist, &tree)?;
        File::create(&done)?;
    }
    Ok(tree)
}

fn sha256_file(path: &Path) -> BoxResult<String> {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    let mut file = File::open(path)?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// The sdist, hash-checked: `FREETOKEN_LLAMA_SDIST`, a cached download, or a fresh one.
fn fetch_sdist(cache: &Path) -> BoxResult<PathBuf> {
    let path = match env::var_os("FREETOKEN_LLAMA_SDIST") {
        Some(p) => PathBuf::from(p),
        None => {
            let dest = cache.join("downloads").join(format!("{}.tar.gz", PIN.name));
            if !dest.is_file() || sha256_file(&dest)? != PIN.sha256 {
                fs::create_dir_all(dest.parent().unwrap())?;
                let part = dest.with_extension("part");
                let status = Command::new("curl")
                    .args(["-fsSL", "--retry", "3", "-o"])
                    .arg(&part)
                    .arg(&PIN.url)
                    .status()
                    .map_err(|e| format!("cannot run curl to download {}: {e}", PIN.url))?;
                if !status.success() {
                    return Err(format!("download of {} failed ({status})", PIN.url).into());
                }
                fs::rename(&part, &dest)?;
            }
            dest
        }
    };
    let got = sha256_file(&path)?;
    if got != PIN.sha256 {
        return Err(format!(
            "{} has sha256 {got}, expected {}",
            path.display(),
            PIN.sha256
        )
        .into());
    }
    Ok(path)
}

/// Unpacks `<sdist>/vendor/llama.cpp/` into `tree`, through a temporary sibling directory so
/// that a crash never leaves a half tree behind.
fn unpack_vendor_tree(sdist: &Path, tree: &Path) -> BoxResult<()> {
    let prefix = Path::new(&PIN.name).join("vendor").join("llama.cpp");
    let tmp = tree.with_extension("tmp");
    if tmp.exists() {
        fs::remove_dir_all(&tmp)?;
    }
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(File::open(sdist)?));
    for entry in archive.entries()? {
        let mut entry = entry?;
        let path = entry.path()?.into_owned();
        let Ok(rel) = path.strip_prefix(&prefix) else {
            continue;
        };
        if rel.as_os_str().is_empty() {
            continue;
        }
        let dest = tmp.join(rel);
        if let Some(parent) = dest.parent() {
            fs::create_dir_all(parent)?;
        }
        entry.unpack(&dest)?;
    }
    if tree.exists() {
        fs::remove_dir_all(tree)?;
    }
    fs::rename(&tmp, tree)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", tree.display())))?;
    Ok(())
}

/// `NAME=VALUE` pairs for the ggml CPU options, and whether the build is native.
fn cpu_options() -> Vec<(String, String)> {
    let explicit = env::var("FREETOKEN_GGML_CPU_OPTIONS").unwrap_or_default();
    let baseline = env::var("FREETOKEN_CPU_BASELINE").is_ok_and(|v| v == "1");
    let list: Vec<String> = if !explicit.trim().is_empty() {
        explicit
            .split([';', ' ', ','])
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    } else if baseline {
        BASELINE_OPTIONS.iter().map(|s| s.to_string()).collect()
    } else {
        return vec![("GGML_NATIVE".into(), "ON".into())];
    };
    let mut opts = vec![("GGML_NATIVE".to_string(), "OFF".to_string())];
    for item in list {
        let (name, value) = item
            .split_once('=')
            .unwrap_or_else(|| panic!("FREETOKEN_GGML_CPU_OPTIONS: `{item}` is not NAME=VALUE"));
        opts.push((name.to_string(), value.to_string()));
    }
    opts
}

fn build_ggml(llama: &Path) {
    let out = PathBuf::from(env::var_os("OUT_DIR").unwrap());
    // Configuring ggml/ alone fails on a missing ggml.pc.in: wrap it in a project of ours.
    let wrapper = out.join("wrapper");
    fs::create_dir_all(&wrapper).unwrap();
    fs::write(
        wrapper.join("CMakeLists.txt"),
        "cmake_minimum_required(VERSION 3.14)\n\
         project(freetoken_ggml C CXX)\n\
         add_subdirectory(${FREETOKEN_GGML_DIR} ggml)\n",
    )
    .unwrap();
    let mut cfg = cmake::Config::new(&wrapper);
    cfg.profile("Release")
        .define("FREETOKEN_GGML_DIR", llama.join("ggml"))
        .define("BUILD_SHARED_LIBS", "OFF")
        .define("CMAKE_POSITION_INDEPENDENT_CODE", "ON")
        .define("GGML_BACKEND_DL", "OFF")
        .define("GGML_OPENMP", "OFF")
        .define("GGML_CCACHE", "OFF")
        .define("GGML_BLAS", "OFF")
        .define("GGML_METAL", "OFF")
        .define("GGML_BUILD_TESTS", "OFF")
        .define("GGML_BUILD_EXAMPLES", "OFF")
        .build_target("ggml-cpu");
    for (name, value) in cpu_options() {
        cfg.define(name, value);
    }
    let dst = cfg.build();
    let lib_dir = dst.join("build").join("ggml").join("src");
    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=static=ggml-cpu");
    println!("cargo:rustc-link-lib=static=ggml-base");
    println!("cargo:rustc-link-lib=dylib=stdc++");
    println!("cargo:rustc-link-lib=dylib=m");
    println!("cargo:rustc-link-lib=dylib=pthread");
}
