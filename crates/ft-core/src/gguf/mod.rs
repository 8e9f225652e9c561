//! GGUF files (split files too), parsed and memory-mapped once. Every count, string,
//! offset and size is checked against the file before it is used.

mod reader;
mod value;

use freetoken_ggml::{Error, GgmlType, Result};
use memmap2::{Advice, Mmap, MmapMut, UncheckedAdvice};
use reader::Reader;
use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
pub use value::Value;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most 4 dimensions.
const MAX_DIMS: u32 = 4;

/// One tensor: its shape in numpy order (the row, `ne[0]`, last), type and place.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    pub shape: Vec<usize>,
    pub ggml_type: GgmlType,
    /// Index of the split file that holds it.
    pub file: usize,
    /// Absolute byte offset in that file.
    pub offset: usize,
    pub nbytes: usize,
}

/// The unit [`GgufFile::release`] drops: the smallest page size, so that a run it drops
/// never reaches outside the view it is given on any host.
pub const PAGE: usize = 4096;

/// A parsed, mapped GGUF model.
pub struct GgufFile {
    paths: Vec<PathBuf>,
    maps: Vec<Mmap>,
    /// Whether `maps` map the files (not copies in anonymous memory).
    file_backed: bool,
    version: u32,
    metadata: Vec<(String, Value)>,
    keys: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    names: HashMap<String, usize>,
}

struct Part {
    map: Mmap,
    version: u32,
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorInfo>,
}

fn map_file(path: &Path) -> Result<Mmap> {
    let file = File::open(path).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
    // SAFETY: the map is read-only; a file truncated underneath us is the one hazard, the
    // same as for llama.cpp's mmap, and we never write through it.
    unsafe { Mmap::map(&file) }
        .map_err(|e| Error::Io(format!("{}: cannot map: {e}", path.display())))
}

fn parse(path: &Path, file_index: usize) -> Result<Part> {
    let map = map_file(path)?;
    let name = path.display().to_string();
    let mut r = Reader::new(&map, &name);
    let magic = r
        .bytes(4, "magic")
        .map_err(|_| Error::Gguf(format!("{name}: not a GGUF file (too short)")))?;
    if magic != MAGIC {
        return Err(Error::Gguf(format!(
            "{name}: not a GGUF file (magic {magic:02x?}, expected \"GGUF\")"
        )));
    }
    let version = r.u32("version")?;
    if version != 2 && version != 3 {
        let why = if version.swap_bytes() <= 3 {
            "a big-endian file".to_string()
        } else {
            format!("version {version}")
        };
        return Err(Error::Unsupported(format!(
            "{name}: unsupported GGUF {why} (versions 2 and 3, little-endian, are supported)"
        )));
    }
    // A tensor info takes at least 8 (name len) + 4 (dims) + 4 (type) + 8 (offset) bytes.
    let n_tensors = r.count(24, "tensor count")?;
    // A key-value pair takes at least 8 (key len) + 4 (type) + 1 bytes.
    let n_kv = r.count(13, "metadata count")?;
    let mut metadata = Vec::with_capacity(n_kv);
    for _ in 0..n_kv {
        let key = r.string("metadata key")?;
        let t = r.u32(&key)?;
        let v = value::read_value(&mut r, t, &key, 2)?;
        metadata.push((key, v));
    }
    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, v)) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() => a,
            _ => return Err(r.err(format!("general.alignment {v:?} is not a power of two"))),
        },
    };
    let mut raw = Vec::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let tname = r.string("tensor name")?;
        let n_dims = r.u32(&tname)?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(r.err(format!("tensor `{tname}` has {n_dims} dimensions")));
        }
        let mut ne = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            ne.push(r.u64(&tname)?);
        }
        let type_id = r.u32(&tname)?;
        let offset = r.u64(&tname)?;
        raw.push((tname, ne, type_id, offset));
    }
    let data_start = (r.pos() as u64).div_ceil(alignment) * alignment;
    let file_len = map.len() as u64;
    if data_start > file_len && n_tensors > 0 {
        return Err(r.err("truncated file: the tensor data section is missing"));
    }
    let mut tensors = Vec::with_capacity(n_tensors);
    for (tname, ne, type_id, offset) in raw {
        let ggml_type = GgmlType::from_id(type_id).map_err(|e| {
            Error::Unsupported(format!("{name}: tensor `{tname}`: {}", e.message()))
        })?;
        if !ggml_type.is_storage() {
            return Err(Error::Unsupported(format!(
                "{name}: tensor `{tname}` has activation-only type {ggml_type}"
            )));
        }
        let shape_err = || {
            Error::Gguf(format!(
                "{name}: tensor `{tname}` has shape {ne:?}, too large"
            ))
        };
        let elems = ne
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(shape_err)?;
        let row = usize::try_from(ne[0]).map_err(|_| shape_err())?;
        let rows =
            usize::try_from(elems.checked_div(ne[0]).unwrap_or(0)).map_err(|_| shape_err())?;
        let nbytes = ggml_type
            .matrix_size(rows, row)
            .map_err(|e| Error::Gguf(format!("{name}: tensor `{tname}`: {}", e.message())))?;
        if offset % alignment != 0 {
            return Err(Error::Gguf(format!(
                "{name}: tensor `{tname}` offset {offset} is not aligned to {alignment}"
            )));
        }
        let start = data_start.checked_add(offset);
        let end = start.and_then(|s| s.checked_add(nbytes as u64));
        match (start, end) {
            (Some(s), Some(e)) if e <= file_len => tensors.push(TensorInfo {
                name: tname,
                shape: ne.iter().rev().map(|&d| d as usize).collect(),
                ggml_type,
                file: file_index,
                offset: s as usize,
                nbytes,
            }),
            _ => {
                return Err(Error::Gguf(format!(
                    "{name}: tensor `{tname}` ({nbytes} bytes at data offset {offset}) runs past \
                     the end of the file ({file_len} bytes): truncated or corrupt"
                )))
            }
        }
    }
    Ok(Part {
        map,
        version,
        metadata,
        tensors,
    })
}

const GIB: f64 = (1u64 << 30) as f64;

/// The kernel's estimate of memory available without swapping (bytes), where it says.
fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The paths of all parts when `path` is the first of a split model (`*-00001-of-0000N.gguf`).
fn split_paths(path: &Path, count: usize) -> Result<Vec<PathBuf>> {
    let fname = path
        .file_name()
        .and_then(|f| f.to_str())
        .unwrap_or_default();
    let suffix = format!("-00001-of-{count:05}.gguf");
    let Some(prefix) = fname.strip_suffix(&suffix) else {
        return Err(Error::Gguf(format!(
            "{}: split model of {count} parts, but the name does not end in {suffix}: open the \
             first part",
            path.display()
        )));
    };
    Ok((1..=count)
        .map(|i| path.with_file_name(format!("{prefix}-{i:05}-of-{count:05}.gguf")))
        .collect())
}

fn meta_u64(meta: &[(String, Value)], key: &str) -> Option<u64> {
    meta.iter()
        .find(|(k, _)| k == key)
        .and_then(|(_, v)| v.as_u64())
}

impl GgufFile {
    /// Opens and maps `path`; for the first part of a split model, every part.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let first = parse(path, 0)?;
        let count = meta_u64(&first.metadata, "split.count").unwrap_or(1) as usize;
        let paths = if count > 1 {
            split_paths(path, count)?
        } else {
            vec![path.to_path_buf()]
        };
        let mut parts = vec![first];
        for (i, p) in paths.iter().enumerate().skip(1) {
            let part = parse(p, i)?;
            if meta_u64(&part.metadata, "split.no") != Some(i as u64) {
                return Err(Error::Gguf(format!(
                    "{}: expected split part {i} of {count}",
                    p.display()
                )));
            }
            parts.push(part);
        }
        let version = parts[0].version;
        let mut maps = Vec::with_capacity(parts.len());
        let mut tensors = Vec::new();
        let mut metadata = Vec::new();
        for (i, part) in parts.into_iter().enumerate() {
            if i == 0 {
                metadata = part.metadata;
            }
            tensors.extend(part.tensors);
            maps.push(part.map);
        }
        let mut names = HashMap::with_capacity(tensors.len());
        for (i, t) in tensors.iter().enumerate() {
            if names.insert(t.name.clone(), i).is_some() {
                return Err(Error::Gguf(format!(
                    "{}: tensor `{}` appears twice",
                    path.display(),
                    t.name
                )));
            }
        }
        let keys = metadata
            .iter()
            .enumerate()
            .map(|(i, (k, _))| (k.clone(), i))
            .collect();
        Ok(GgufFile {
            paths,
            maps,
            file_backed: true,
            version,
            metadata,
            keys,
            tensors,
            names,
        })
    }

    /// The files of the model (one, or every split part).
    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    /// The GGUF version of the first part.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Metadata in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// One metadata value.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.keys.get(key).map(|&i| &self.metadata[i].1)
    }

    /// All tensors, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor called `name`; a GGUF error naming it when it is missing.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.names
            .get(name)
            .map(|&i| &self.tensors[i])
            .ok_or_else(|| Error::Gguf(format!("missing tensor `{name}`")))
    }

    /// The bytes of a tensor, borrowed from the mapping.
    pub fn data(&self, t: &TensorInfo) -> &[u8] {
        self.bytes(t.file, t.offset, t.nbytes)
    }

    /// `len` bytes at `offset` of split part `file`; callers pass ranges derived from this
    /// file's tensor infos, which were checked against the file at open.
    pub fn bytes(&self, file: usize, offset: usize, len: usize) -> &[u8] {
        &self.maps[file][offset..offset + len]
    }

    /// The map holding all `len` bytes at address `at`.
    fn map_of(&self, at: usize, len: usize) -> Result<&Mmap> {
        self.maps
            .iter()
            .find(|m| {
                let start = m.as_ptr() as usize;
                at >= start
                    && at
                        .checked_add(len)
                        .is_some_and(|end| end <= start + m.len())
            })
            .ok_or_else(|| {
                Error::InvalidInput(format!(
                    "{len} bytes at {at:#x} are not inside the mapping of {}",
                    self.paths[0].display()
                ))
            })
    }

    /// Whether `bytes` lie inside the mapping; an error naming the file if not.
    pub fn check_mapped(&self, bytes: &[u8]) -> Result<()> {
        self.map_of(bytes.as_ptr() as usize, bytes.len())
            .map(|_| ())
    }

    /// Drops this process's pages of `bytes`, a view of the mapping, for callers that keep
    /// their own copy of them (weights packed for the CPU kernels): the kernel reads them
    /// from the file again if they are touched later, so the process stops holding both.
    /// Only whole [`PAGE`]-aligned runs inside the view are dropped, leaving the neighbours'
    /// pages; copies in anonymous memory (`read_into_memory`) have no file to read from and
    /// keep theirs. A view outside the mapping is an error. Returns the bytes dropped.
    pub fn release(&self, bytes: &[u8]) -> Result<usize> {
        let (at, len) = (bytes.as_ptr() as usize, bytes.len());
        let map = self.map_of(at, len)?;
        let (first, end) = (at.next_multiple_of(PAGE), (at + len) / PAGE * PAGE);
        if !self.file_backed || end <= first {
            return Ok(0);
        }
        // SAFETY: the map is a read-only, private file mapping that is never written, so a
        // dropped page reads back from the file with the bytes it held: views of it see no
        // change (the hazard is the map's own, a file changed underneath).
        unsafe {
            map.unchecked_advise_range(
                UncheckedAdvice::DontNeed,
                first - map.as_ptr() as usize,
                end - first,
            )
        }
        .map_err(|e| Error::Io(format!("cannot release mapped pages: {e}")))?;
        Ok(end - first)
    }

    /// Bytes of all parts together.
    pub fn total_bytes(&self) -> u64 {
        self.maps.iter().map(|m| m.len() as u64).sum()
    }

    /// Replaces each part's file mapping with a copy in anonymous memory that the kernel may
    /// back with 2 MiB pages (llama.cpp's `--no-mmap`, with `MADV_HUGEPAGE`): fewer TLB misses
    /// while the CPU streams experts, 3-7% faster (benches/README.md). Call before any view of
    /// the data is taken. `progress(done, total)` after each chunk read.
    pub fn read_into_memory(&mut self, mut progress: impl FnMut(u64, u64)) -> Result<()> {
        const CHUNK: usize = 64 << 20;
        let total = self.total_bytes();
        // Anonymous memory is not paged back to the file: a copy larger than what the host
        // has free would end in the OOM killer, not in an error.
        if let Some(avail) = mem_available() {
            if total > avail {
                return Err(Error::InvalidInput(format!(
                    "{}: reading the model's {:.1} GiB into memory needs more than the {:.1} GiB \
                     available (MemAvailable); keep it memory-mapped",
                    self.paths[0].display(),
                    total as f64 / GIB,
                    avail as f64 / GIB
                )));
            }
        }
        let mut done = 0u64;
        for (map, path) in self.maps.iter_mut().zip(&self.paths) {
            let io = |what: &str, e: std::io::Error| {
                Error::Io(format!("{}: {what}: {e}", path.display()))
            };
            let mut anon = MmapMut::map_anon(map.len())
                .map_err(|e| io("cannot allocate memory for the model", e))?;
            // Advice only: without transparent huge pages the copy still works.
            let _ = anon.advise(Advice::HugePage);
            let mut file = File::open(path).map_err(|e| io("cannot open", e))?;
            for chunk in anon.chunks_mut(CHUNK) {
                file.read_exact(chunk).map_err(|e| io("cannot read", e))?;
                done += chunk.len() as u64;
                progress(done, total);
            }
            // Same length as the mapping, so every offset checked at open stays in bounds (a
            // file shortened since fails read_exact above).
            *map = anon
                .make_read_only()
                .map_err(|e| io("cannot protect the copy", e))?;
        }
        self.file_backed = false;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn gguf_bytes(tensor_offset: u64, data_len: usize) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes()); // tensors
        b.extend_from_slice(&1u64.to_le_bytes()); // kv
        let key = b"general.architecture";
        b.extend_from_slice(&(key.len() as u64).to_le_bytes());
        b.extend_from_slice(key);
        b.extend_from_slice(&8u32.to_le_bytes());
        b.extend_from_slice(&5u64.to_le_bytes());
        b.extend_from_slice(b"llama");
        let name = b"w";
        b.extend_from_slice(&(name.len() as u64).to_le_bytes());
        b.extend_from_slice(name);
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&4u64.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes()); // F32
        b.extend_from_slice(&tensor_offset.to_le_bytes());
        while b.len() % 32 != 0 {
            b.push(0);
        }
        b.extend(std::iter::repeat_n(0u8, data_len));
        b
    }

    fn write(bytes: &[u8], name: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("ft-core-{}-{name}.gguf", std::process::id()));
        File::create(&p).unwrap().write_all(bytes).unwrap();
        p
    }

    #[test]
    fn reads_a_valid_file() {
        let p = write(&gguf_bytes(0, 32), "ok");
        let f = GgufFile::open(&p).unwrap();
        assert_eq!(
            f.get("general.architecture").and_then(Value::as_str),
            Some("llama")
        );
        let t = f.tensor("w").unwrap();
        assert_eq!(t.shape, vec![2, 4]);
        assert_eq!(f.data(t).len(), 32);
        assert!(f.tensor("missing").is_err());
    }

    #[test]
    fn rejects_truncated_and_out_of_range() {
        let full = gguf_bytes(0, 32);
        for cut in [0, 3, 10, 30, full.len() - 1] {
            let p = write(&full[..cut], &format!("cut{cut}"));
            assert!(
                matches!(GgufFile::open(&p), Err(Error::Gguf(_))),
                "cut at {cut}"
            );
        }
        let p = write(&gguf_bytes(64, 32), "past");
        let e = GgufFile::open(&p).err().unwrap();
        assert!(e.message().contains("runs past"), "{e}");
    }

    #[test]
    fn read_into_memory_keeps_every_byte_and_reports_progress() {
        let mut bytes = gguf_bytes(0, 32);
        let n = bytes.len();
        bytes[n - 32..]
            .iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = i as u8 * 7 + 1);
        let p = write(&bytes, "read");
        let mut f = GgufFile::open(&p).unwrap();
        let mut seen = vec![];
        f.read_into_memory(|done, total| seen.push((done, total)))
            .unwrap();
        assert_eq!(seen.last(), Some(&(n as u64, n as u64)));
        assert_eq!(f.bytes(0, 0, n), &bytes[..]);
        assert_eq!(f.data(f.tensor("w").unwrap()), &bytes[n - 32..]);
        // A file shortened after it was parsed is an error, not a short copy.
        let mut g = GgufFile::open(&p).unwrap();
        File::create(&p)
            .unwrap()
            .write_all(&bytes[..n - 1])
            .unwrap();
        let e = g.read_into_memory(|_, _| {}).err().unwrap();
        assert!(
            matches!(e, Error::Io(_)) && e.message().contains("cannot read"),
            "{e}"
        );
    }

    /// Released pages read back with the file's bytes (whole 4 KiB runs dropped, the
    /// partial ones kept), an anonymous copy drops nothing and keeps its bytes, and a view
    /// outside the mapping is refused.
    #[test]
    fn released_pages_read_back_from_the_file() {
        let mut bytes = gguf_bytes(0, 3 << 12);
        let header = bytes.len() - (3 << 12);
        bytes
            .iter_mut()
            .skip(header)
            .enumerate()
            .for_each(|(i, b)| *b = (i * 31 % 251) as u8);
        let p = write(&bytes, "release");
        let n = bytes.len();
        let mut f = GgufFile::open(&p).unwrap();
        let outside = vec![1u8; 8192];
        for copy in [false, true] {
            if copy {
                f.read_into_memory(|_, _| {}).unwrap();
            }
            let all = f.bytes(0, 0, n);
            assert_eq!(all, &bytes[..]);
            let at = all.as_ptr() as usize;
            // From byte 100 to the end: the runs of the second and later 4 KiB pages.
            let dropped = f.release(&all[100..]).unwrap();
            let runs = (at + n) / PAGE * PAGE - (at + 100).next_multiple_of(PAGE);
            assert_eq!(dropped, if copy { 0 } else { runs }, "copy {copy}");
            assert_eq!(f.bytes(0, 0, n), &bytes[..], "copy {copy}");
            assert!(f.check_mapped(&all[1..]).is_ok());
            let e = f.release(&outside).err().unwrap();
            assert!(matches!(e, Error::InvalidInput(_)), "{e}");
            assert!(f.check_mapped(&outside).is_err());
        }
    }
}
