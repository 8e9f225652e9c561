//! Finding and opening `libfreetoken_cuda.so`, checking its ABI, and the process's runtime.

use crate::abi::*;
use freetoken_ggml::Error;
use freetoken_ggml::Result;
use std::ffi::{c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The library's file name.
pub const LIB_NAME: &str = "libfreetoken_cuda.so";
/// The environment variable naming the library (or its folder).
pub const LIB_ENV: &str = "FREETOKEN_CUDA_LIB";

/// The library's entry points. The handle is never closed: the library holds CUDA state
/// (contexts, scratch pools) for the life of the process.
pub(crate) struct Api {
    pub(crate) device_info: FnDeviceInfo,
    pub(crate) kernel_for: FnKernelFor,
    pub(crate) expert_matmul: FnMatmul,
    pub(crate) moe_layer: FnMoe,
    pub(crate) handoff_wait_add: FnHandoff,
    pub(crate) handoff_routes: FnHandoffRoutes,
    pub(crate) norm_rope: FnNormRope,
    pub(crate) topk_softmax: FnTopkSoftmax,
    pub(crate) attn_decode: FnAttnDecode,
    pub(crate) attn_decode_work: FnAttnDecodeWork,
    pub(crate) gdn_decode: FnGdnDecode,
    pub(crate) fetch_plan: FnFetchPlan,
    pub(crate) fetch_gather: FnFetchGather,
    pub(crate) last_error: FnLastError,
}

/// The loaded library and the devices it found.
pub struct Cuda {
    pub(crate) api: Api,
    path: PathBuf,
    pub(crate) n_devices: i32,
}

// SAFETY: the library serializes its entry points behind one mutex and keeps no thread-bound
// state but its per-thread error message, which each call reads on the calling thread.
unsafe impl Send for Cuda {}
unsafe impl Sync for Cuda {}

static RUNTIME: OnceLock<std::result::Result<Cuda, String>> = OnceLock::new();

/// The GPU runtime, loaded on first use; `Unsupported` with the reason when there is none
/// (the caller decides whether and how to tell the user).
pub fn runtime() -> Result<&'static Cuda> {
    RUNTIME
        .get_or_init(|| locate().and_then(|p| Cuda::load(&p)))
        .as_ref()
        .map_err(|why| Error::Unsupported(format!("the GPU is not available: {why}")))
}

/// Whether a library file is where [`runtime`] looks for one (loadable or not).
pub fn library_present() -> bool {
    locate().is_ok_and(|p| p.is_file())
}

/// Whether a GPU runtime is loaded and found at least one device (loads it on first call).
pub fn available() -> bool {
    runtime().is_ok()
}

/// The library's path: `FREETOKEN_CUDA_LIB`, else next to the module holding this code.
fn locate() -> std::result::Result<PathBuf, String> {
    if let Some(p) = std::env::var_os(LIB_ENV) {
        let p = PathBuf::from(p);
        return Ok(if p.is_dir() { p.join(LIB_NAME) } else { p });
    }
    let here = module_dir().ok_or("cannot tell where the extension module lives")?;
    let p = here.join(LIB_NAME);
    if p.is_file() {
        Ok(p)
    } else {
        Err(format!(
            "{LIB_NAME} is not next to the extension in {} and {LIB_ENV} is not set",
            here.display()
        ))
    }
}

/// The folder of the shared object (or executable) this function is linked into.
fn module_dir() -> Option<PathBuf> {
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the loader's tables; the address is one of our functions.
    let ok = unsafe { libc::dladdr(module_dir as *const c_void, &mut info) };
    if ok == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated path owned by the loader.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    let path = PathBuf::from(name.to_string_lossy().into_owned());
    let path = path.canonicalize().unwrap_or(path);
    path.parent().map(Path::to_path_buf)
}

fn dl_error() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated message owned by libc.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown dlopen error".into()
    } else {
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

/// # Safety
/// `T` must be the function pointer type of the symbol `name` in the library.
unsafe fn symbol<T: Copy>(handle: *mut c_void, name: &str) -> std::result::Result<T, String> {
    debug_assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>());
    let c = CString::new(name).expect("symbol names have no NUL");
    let p = libc::dlsym(handle, c.as_ptr());
    if p.is_null() {
        return Err(format!("missing symbol {name}: {}", dl_error()));
    }
    Ok(std::mem::transmute_copy::<*mut c_void, T>(&p))
}

fn status_error(code: i32, msg: String) -> Error {
    match code {
        1 => Error::InvalidInput(msg),
        2 => Error::Shape(msg),
        3 => Error::Unsupported(msg),
        4 => Error::OutOfMemory(msg),
        _ => Error::Device(format!("CUDA: {msg}")),
    }
}

impl Cuda {
    /// Opens the library at `path`, checks its ABI and finds the devices.
    pub fn load(path: &Path) -> std::result::Result<Cuda, String> {
        let cpath = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| format!("{} has a NUL byte", path.display()))?;
        // SAFETY: loading runs the library's static initializers, which only set up tables.
        let handle = unsafe { libc::dlopen(cpath.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(format!("cannot load {}: {}", path.display(), dl_error()));
        }
        // SAFETY: each type below is the C signature of the named function in freetoken_cuda.h.
        unsafe {
            let abi: FnAbiVersion = symbol(handle, "ft_cuda_abi_version")?;
            let got = abi();
            if got != ABI_VERSION {
                return Err(format!(
                    "{} speaks C ABI {got}, this build needs {ABI_VERSION}: it is from another \
                     build (rebuild it with this one: FREETOKEN_CUDA=1 pip install)",
                    path.display()
                ));
            }
            let struct_size: FnStructSize = symbol(handle, "ft_cuda_struct_size")?;
            for (which, name, want) in struct_sizes() {
                let got = struct_size(which);
                if got != want as u64 {
                    return Err(format!("{name} is {got} bytes in the library, {want} here"));
                }
            }
            let init: FnInit = symbol(handle, "ft_cuda_init")?;
            let api = Api {
                device_info: symbol(handle, "ft_cuda_device_info_get")?,
                kernel_for: symbol(handle, "ft_cuda_kernel_for")?,
                expert_matmul: symbol(handle, "ft_cuda_expert_matmul")?,
                moe_layer: symbol(handle, "ft_cuda_moe_layer")?,
                handoff_wait_add: symbol(handle, "ft_cuda_handoff_wait_add")?,
                handoff_routes: symbol(handle, "ft_cuda_handoff_routes")?,
                norm_rope: symbol(handle, "ft_cuda_norm_rope")?,
                topk_softmax: symbol(handle, "ft_cuda_topk_softmax")?,
                attn_decode: symbol(handle, "ft_cuda_attn_decode")?,
                attn_decode_work: symbol(handle, "ft_cuda_attn_decode_work")?,
                gdn_decode: symbol(handle, "ft_cuda_gdn_decode")?,
                fetch_plan: symbol(handle, "ft_cuda_fetch_plan")?,
                fetch_gather: symbol(handle, "ft_cuda_fetch_gather")?,
                last_error: symbol(handle, "ft_cuda_last_error")?,
            };
            let mut n = 0i32;
            if init(&mut n) != OK {
                let msg = CStr::from_ptr((api.last_error)())
                    .to_string_lossy()
                    .into_owned();
                return Err(msg);
            }
            Ok(Cuda {
                api,
                path: path.to_path_buf(),
                n_devices: n,
            })
        }
    }

    /// Where the library was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// CUDA devices found.
    pub fn n_devices(&self) -> i32 {
        self.n_devices
    }

    /// `Ok` for the library's OK, else its error and message.
    pub(crate) fn status(&self, rc: i32) -> Result<()> {
        if rc == OK {
            Ok(())
        } else {
            Err(self.last_error(rc))
        }
    }

    pub(crate) fn last_error(&self, code: i32) -> Error {
        // SAFETY: the library returns its thread-local message, valid until its next call here.
        let msg = unsafe { CStr::from_ptr((self.api.last_error)()) }
            .to_string_lossy()
            .into_owned();
        status_error(code, msg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_reported_with_its_path() {
        let err = Cuda::load(Path::new("/nonexistent/libfreetoken_cuda.so"))
            .err()
            .unwrap();
        assert!(err.contains("/nonexistent/libfreetoken_cuda.so"), "{err}");
    }

    #[test]
    fn a_library_without_the_abi_is_refused() {
        // libc is loaded in every process and has none of our symbols.
        let err = Cuda::load(Path::new("libc.so.6")).err().unwrap();
        assert!(err.contains("missing symbol ft_cuda_abi_version"), "{err}");
    }

    #[test]
    fn the_module_folder_is_found() {
        let dir = module_dir().expect("dladdr finds the test binary");
        assert!(dir.is_dir());
    }
}
