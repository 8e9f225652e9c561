//! A GGUF file's bytes through `GgufFile::open`: every input must give a file whose tensors
//! all lie inside its mapping, or an error; never a panic, a crash or an out-of-bounds read.

#![no_main]

use ft_core::gguf::GgufFile;
use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;
use std::sync::OnceLock;

fn scratch() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = if std::path::Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        dir.join(format!("ft-fuzz-gguf-{}.gguf", std::process::id()))
    })
}

fuzz_target!(|data: &[u8]| {
    let path = scratch();
    std::fs::write(path, data).expect("the scratch file is writable");
    let Ok(file) = GgufFile::open(path) else {
        return;
    };
    let mut sum = 0u64;
    for t in file.tensors() {
        let bytes = file.data(t);
        // Touch both ends: a view past the mapping would fault here.
        if let (Some(a), Some(b)) = (bytes.first(), bytes.last()) {
            sum = sum.wrapping_add(*a as u64 + *b as u64);
        }
    }
    std::hint::black_box(sum);
    for (key, _) in file.metadata() {
        std::hint::black_box(file.get(key));
    }
});
