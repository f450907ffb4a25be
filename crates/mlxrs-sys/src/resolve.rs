//! Where the native runtime comes from, in order: `MLXRS_LIBMLXC` → sidecar beside the extension
//! module → the native-pack cache → Homebrew. Linux: libmlx beside libmlxc, else from the installed
//! `mlx` pip package; on CPU an optimized BLAS is preloaded into the global namespace first.
use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};

/// The mlx-c release this build of mlxrs was written against (with native/patches/ applied, which
/// bring it to MLX 0.32; the signature table is the real check, see `signature_mismatch`).
pub const BUILT_FOR_MLXC: &str = "0.5.0";
/// The MLX release libmlxc is built against (the pip `mlx` version).
pub const BUILT_FOR_MLX: &str = "0.32.4";
/// Version of the native pack layout/contents (`native-v<ver>-<os>-<arch>-<backend>`).
pub const NATIVE_PACK_VERSION: &str = "0.32.4";

#[cfg(target_os = "macos")]
pub const LIBMLXC: &str = "libmlxc.dylib";
#[cfg(not(target_os = "macos"))]
pub const LIBMLXC: &str = "libmlxc.so";
#[cfg(target_os = "macos")]
pub const LIBMLX: &str = "libmlx.dylib";
#[cfg(not(target_os = "macos"))]
pub const LIBMLX: &str = "libmlx.so";
/// Our gemv router for MLX's CPU backend (native/blas_gemv.c; Linux only), beside libmlxc.
pub const BLAS_GEMV: &str = "libmlxrs_blas.so";

/// Where the gemv router may be: beside libmlxc, then beside the extension module.
fn blas_gemv_candidates(libmlxc: &Path) -> Vec<PathBuf> {
    libmlxc.parent().into_iter().map(Path::to_path_buf).chain(this_module_dir()).map(|d| d.join(BLAS_GEMV)).collect()
}

/// Which rung of the resolution order supplied libmlxc.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Env,
    Sidecar,
    NativePack,
    Homebrew,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Source::Env => "MLXRS_LIBMLXC",
            Source::Sidecar => "sidecar",
            Source::NativePack => "native-pack cache",
            Source::Homebrew => "homebrew",
        })
    }
}

/// What was loaded and from where.
#[derive(Clone, Debug)]
pub struct Runtime {
    pub source: Source,
    pub libmlxc: PathBuf,
    pub libmlx: Option<PathBuf>,
    /// The optimized BLAS preloaded for MLX's CPU backend, if any.
    pub blas: Option<PathBuf>,
    /// `libmlxrs_blas` (native/blas_gemv.c), loaded ahead of the BLAS so that MLX's float32
    /// matrix-vector products run as gemv; None when absent, disabled or not applicable.
    pub blas_gemv: Option<PathBuf>,
    /// libmlx was in the process before mlxrs could put the BLAS ahead of it (Python's `mlx.core`
    /// imported before `mlxrs`): its BLAS calls were bound to MLX's own reference BLAS then, so
    /// nothing was preloaded ([`Resolver::preload_blas`]).
    pub mlx_loaded_first: bool,
}

/// What [`Resolver::preload_blas`] put in the process's global scope (once per process).
#[derive(Clone, Debug, Default)]
pub struct BlasPreload {
    pub blas: Option<PathBuf>,
    pub blas_gemv: Option<PathBuf>,
    pub mlx_loaded_first: bool,
}

static BLAS_PRELOAD: std::sync::Mutex<Option<BlasPreload>> = std::sync::Mutex::new(None);

/// The files mapped into this process (Linux: /proc/self/maps' path column; empty elsewhere).
fn mapped_files() -> Vec<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    maps.lines().filter_map(|l| l.split_whitespace().nth(5)).map(str::to_string).collect()
}

/// Whether a libmlx is mapped into this process already.
fn libmlx_mapped() -> bool {
    mapped_files().iter().any(|p| Path::new(p).file_name() == Some(LIBMLX.as_ref()))
}

#[derive(Debug)]
pub enum LoadError {
    /// Nothing found anywhere: every place tried, then the two escapes.
    NotFound { tried: Vec<String> },
    /// `MLXRS_LIBMLXC` names a file that is not there.
    EnvMissing { path: PathBuf },
    /// A library was found but could not be opened.
    Open { path: PathBuf, detail: String },
    /// The library is not the mlx-c / MLX this build expects.
    Mismatch { path: PathBuf, detail: String },
}

impl std::error::Error for LoadError {}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::NotFound { tried } => {
                writeln!(f, "mlxrs could not find its native runtime ({LIBMLXC}, mlx-c v{BUILT_FOR_MLXC}). Tried:")?;
                for t in tried {
                    writeln!(f, "  - {t}")?;
                }
                write!(
                    f,
                    "Fix: set MLXRS_LIBMLXC=/path/to/{LIBMLXC} (your own build; libmlx beside it or from pip `mlx`), \
                     or fetch the prebuilt pack with `python -m mlxrs native --fetch` \
                     (MLXRS_NATIVE_PACK_URL overrides where it comes from)."
                )
            }
            LoadError::EnvMissing { path } => write!(
                f,
                "MLXRS_LIBMLXC={} does not exist; point it at a built {LIBMLXC} or unset it",
                path.display()
            ),
            LoadError::Open { path, detail } => write!(f, "could not load {}: {detail}", path.display()),
            LoadError::Mismatch { path, detail } => write!(
                f,
                "{} is not the native runtime this mlxrs was built for: {detail}. \
                 Rebuild it (python native/build.py) or point MLXRS_LIBMLXC at mlx-c v{BUILT_FOR_MLXC} built against MLX {BUILT_FOR_MLX}",
                path.display()
            ),
        }
    }
}

/// The places searched, as data, so tests can point every rung at temporary directories.
#[derive(Clone, Debug, Default)]
pub struct Resolver {
    /// `MLXRS_LIBMLXC`.
    pub env_libmlxc: Option<PathBuf>,
    /// The directory holding the extension module (the sidecar location).
    pub sidecar_dir: Option<PathBuf>,
    /// Native-pack cache directories for this platform, best first.
    pub pack_dirs: Vec<PathBuf>,
    /// System prefixes (Homebrew).
    pub system_dirs: Vec<PathBuf>,
    /// Extra places to look for libmlx when it is not beside libmlxc.
    pub mlx_lib_dirs: Vec<PathBuf>,
    /// `MLXRS_BLAS`: None = auto, Some("off") = none, Some(path) = that library.
    pub blas: Option<OsString>,
    /// `MLXRS_BLAS_GEMV`: `off`/`0` skips `libmlxrs_blas` (see [`BLAS_GEMV`]).
    pub blas_gemv_off: bool,
}

/// `~/.cache/mlxrs` or `$MLXRS_HOME`.
pub fn mlxrs_home() -> Option<PathBuf> {
    if let Some(h) = std::env::var_os("MLXRS_HOME") {
        return Some(PathBuf::from(h));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("mlxrs"))
}

/// `native-v<ver>-<os>-<arch>-<backend>` under the mlxrs home.
pub fn native_pack_dir(home: &Path, backend: &str) -> PathBuf {
    let os = if cfg!(target_os = "macos") { "macos" } else { std::env::consts::OS };
    home.join(format!("native-v{NATIVE_PACK_VERSION}-{os}-{}-{backend}", std::env::consts::ARCH))
}

/// Backends whose pack could serve this machine, best first.
pub fn candidate_backends() -> Vec<&'static str> {
    if cfg!(target_os = "macos") {
        return vec!["metal"];
    }
    match std::env::var("MLXRS_BACKEND").ok().as_deref() {
        Some("cuda") => vec!["cuda"],
        Some("cpu") => vec!["cpu"],
        _ => vec!["cuda", "cpu"],
    }
}

impl Resolver {
    /// The resolver for this process: environment variables, the directory of the module this crate
    /// is linked into, `$MLXRS_HOME` (else `~/.cache/mlxrs`), Homebrew prefixes.
    pub fn from_env() -> Self {
        let home = mlxrs_home();
        let mut mlx_lib_dirs = Vec::new();
        if let Some(d) = std::env::var_os("MLXRS_MLX_LIB_DIR") {
            mlx_lib_dirs.push(PathBuf::from(d));
        }
        mlx_lib_dirs.extend(registered_mlx_dirs());
        if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
            mlx_lib_dirs.extend(site_packages_mlx(Path::new(&venv)));
        }
        Resolver {
            env_libmlxc: std::env::var_os("MLXRS_LIBMLXC").filter(|v| !v.is_empty()).map(PathBuf::from),
            sidecar_dir: this_module_dir(),
            pack_dirs: home
                .map(|h| candidate_backends().into_iter().map(|b| native_pack_dir(&h, b)).collect())
                .unwrap_or_default(),
            system_dirs: vec![PathBuf::from("/opt/homebrew/lib"), PathBuf::from("/usr/local/lib")],
            mlx_lib_dirs,
            blas: std::env::var_os("MLXRS_BLAS"),
            blas_gemv_off: std::env::var("MLXRS_BLAS_GEMV")
                .map(|v| matches!(v.trim(), "off" | "0" | "false" | "no"))
                .unwrap_or(false),
        }
    }

    /// Find libmlxc without opening anything: the first hit, or every place tried.
    pub fn find(&self) -> Result<(Source, PathBuf), LoadError> {
        let mut tried = Vec::new();
        if let Some(p) = &self.env_libmlxc {
            if p.is_file() {
                return Ok((Source::Env, p.clone()));
            }
            return Err(LoadError::EnvMissing { path: p.clone() });
        }
        tried.push("MLXRS_LIBMLXC (not set)".to_string());
        let rungs = self
            .sidecar_dir
            .iter()
            .map(|d| (Source::Sidecar, d))
            .chain(self.pack_dirs.iter().map(|d| (Source::NativePack, d)))
            .chain(self.system_dirs.iter().map(|d| (Source::Homebrew, d)));
        for (src, dir) in rungs {
            let p = dir.join(LIBMLXC);
            if p.is_file() {
                return Ok((src, p));
            }
            tried.push(format!("{src}: {}", p.display()));
        }
        Err(LoadError::NotFound { tried })
    }

    /// Where libmlx is, for a libmlxc at `libmlxc`: beside it, then the known pip locations.
    pub fn find_libmlx(&self, libmlxc: &Path) -> Option<PathBuf> {
        let beside = libmlxc.parent().map(|d| d.join(LIBMLX));
        let pip_layout = libmlxc.parent().and_then(|d| d.parent()).map(|d| d.join("mlx").join("lib").join(LIBMLX));
        beside
            .into_iter()
            .chain(pip_layout)
            .chain(self.mlx_lib_dirs.iter().map(|d| d.join(LIBMLX)))
            .find(|p| p.is_file())
    }

    /// Put an optimized BLAS (Linux CPU), with the gemv router ahead of it, into the global scope
    /// before libmlx loads, so that libmlx — opened by [`crate::load`] or by Python's `import
    /// mlx.core` afterwards — binds `cblas_sgemm` to the router and everything else to the BLAS.
    /// Once per process: later calls return what the first successful one did. Nothing where
    /// libmlx is mapped already (`mlx_loaded_first`: bound to MLX's own BLAS, which nothing can
    /// change now), on a CUDA build of MLX, off Linux or with `MLXRS_BLAS=off`. The extension calls
    /// this when it is imported ([`preload_blas_early`]); loading calls it again.
    pub fn preload_blas(&self, libmlxc: &Path, libmlx: Option<&Path>) -> Result<BlasPreload, LoadError> {
        let mut done = BLAS_PRELOAD.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = &*done {
            return Ok(d.clone());
        }
        let state = if is_cuda_mlx(libmlx) || !cfg!(target_os = "linux") || blas_disabled(self.blas.as_deref()) {
            BlasPreload::default()
        } else if libmlx_mapped() {
            BlasPreload { mlx_loaded_first: true, ..BlasPreload::default() }
        } else {
            // The BLAS opens locally first; the gemv router (when present) goes into the global
            // scope, then the BLAS is promoted after it.
            let blas = open_blas_local(self.blas.as_deref())?;
            let router = blas_gemv_candidates(libmlxc).into_iter().find(|p| p.is_file());
            let blas_gemv = match (&blas, router) {
                (Some((_, _, local)), Some(p)) if !self.blas_gemv_off => {
                    let lib = open_global(&p).map_err(|detail| LoadError::Open {
                        path: p.clone(),
                        detail: format!("{detail} (set MLXRS_BLAS_GEMV=off to skip it)"),
                    })?;
                    bind_gemv(&lib, local);
                    std::mem::forget(lib);
                    Some(p)
                }
                _ => None,
            };
            let blas = match blas {
                Some((path, name, local)) => {
                    let global = open_global(Path::new(&name))
                        .map_err(|detail| LoadError::Open { path: path.clone(), detail })?;
                    std::mem::forget(global);
                    std::mem::forget(local);
                    Some(path)
                }
                None => None,
            };
            BlasPreload { blas, blas_gemv, mlx_loaded_first: false }
        };
        *done = Some(state.clone());
        Ok(state)
    }

    /// Find and open: BLAS (Linux CPU, [`Resolver::preload_blas`]), then libmlx, then libmlxc.
    pub(crate) fn open(&self) -> Result<(Runtime, libloading::Library), LoadError> {
        let (source, libmlxc) = self.find()?;
        let libmlx = self.find_libmlx(&libmlxc);
        let BlasPreload { blas, blas_gemv, mlx_loaded_first } = self.preload_blas(&libmlxc, libmlx.as_deref())?;
        if let Some(m) = &libmlx {
            let lib = open_global(m).map_err(|detail| LoadError::Open { path: m.clone(), detail })?;
            std::mem::forget(lib);
        }
        let lib = open_global(&libmlxc).map_err(|detail| LoadError::Open {
            path: libmlxc.clone(),
            detail: if libmlx.is_none() {
                format!("{detail} (libmlx was not found beside it nor in a pip `mlx` package: pip install 'mlx==0.32.4' or set MLXRS_MLX_LIB_DIR)")
            } else {
                detail
            },
        })?;
        Ok((Runtime { source, libmlxc, libmlx, blas, blas_gemv, mlx_loaded_first }, lib))
    }
}

/// [`Resolver::preload_blas`] with the default resolver, where libmlxc is found without fetching
/// anything (the extension calls this when Python imports it, before anything may import
/// `mlx.core`): what it did, or None where it could not tell yet (nothing found, or a failure, which
/// loading reports).
pub fn preload_blas_early() -> Option<BlasPreload> {
    let r = Resolver::from_env();
    let (_, libmlxc) = r.find().ok()?;
    let libmlx = r.find_libmlx(&libmlxc);
    r.preload_blas(&libmlxc, libmlx.as_deref()).ok()
}

/// Directories registered by the embedding program (the Python module registers the `mlx` package's).
static REGISTERED: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

/// Tell the resolver about a directory that may hold libmlx (before [`crate::load`]).
pub fn register_mlx_lib_dir(dir: PathBuf) {
    REGISTERED.lock().unwrap_or_else(|e| e.into_inner()).push(dir);
}

fn registered_mlx_dirs() -> Vec<PathBuf> {
    REGISTERED.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

fn site_packages_mlx(prefix: &Path) -> Vec<PathBuf> {
    let lib = prefix.join("lib");
    let Ok(rd) = std::fs::read_dir(&lib) else { return Vec::new() };
    rd.flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("python"))
        .map(|e| e.path().join("site-packages").join("mlx").join("lib"))
        .collect()
}

/// A CUDA build of libmlx sits beside the nvidia packages or links libcudart; its CPU path does
/// not need BLAS preloading.
fn is_cuda_mlx(libmlx: Option<&Path>) -> bool {
    let Some(p) = libmlx else { return false };
    // the pip CUDA wheel is mlx-cuda-*; its dist-info sits in site-packages
    let site = p.parent().and_then(|d| d.parent()).and_then(|d| d.parent());
    site.and_then(|s| std::fs::read_dir(s).ok())
        .map(|rd| rd.flatten().any(|e| e.file_name().to_string_lossy().starts_with("mlx_cuda")))
        .unwrap_or(false)
}

const BLAS_CANDIDATES: &[&str] = &[
    "libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "libopenblas.so",
];

/// `MLXRS_BLAS=off` (or `0`, or empty).
fn blas_disabled(choice: Option<&std::ffi::OsStr>) -> bool {
    choice.map(|c| c.to_string_lossy()).is_some_and(|c| c == "off" || c == "0" || c.is_empty())
}

/// Open an optimized BLAS (Linux) with local scope: `MLXRS_BLAS=off` disables it, a path chooses
/// it (and must load), unset tries OpenBLAS's usual names. Returns the file, the name it was opened
/// by, and the handle; the caller promotes it to the global scope.
fn open_blas_local(
    choice: Option<&std::ffi::OsStr>,
) -> Result<Option<(PathBuf, std::ffi::OsString, libloading::Library)>, LoadError> {
    if !cfg!(target_os = "linux") || blas_disabled(choice) {
        return Ok(None);
    }
    match choice {
        Some(path) => match open_local(Path::new(path)) {
            Ok(l) => Ok(Some((PathBuf::from(path), path.to_owned(), l))),
            Err(detail) => Err(LoadError::Open {
                path: PathBuf::from(path),
                detail: format!("{detail} (MLXRS_BLAS names it; set MLXRS_BLAS=off to use MLX's own BLAS)"),
            }),
        },
        None => Ok(BLAS_CANDIDATES
            .iter()
            .find_map(|c| open_local(Path::new(c)).ok().map(|l| (resolved_path(c), (*c).into(), l)))),
    }
}

/// Hand the preloaded BLAS's `cblas_sgemm`/`cblas_sgemv` to `libmlxrs_blas`. Should the BLAS lack
/// either, the router finds the next definitions itself on first use.
fn bind_gemv(router: &libloading::Library, blas: &libloading::Library) {
    type Bind = unsafe extern "C" fn(*mut std::ffi::c_void, *mut std::ffi::c_void) -> std::os::raw::c_int;
    // SAFETY: the symbols are looked up by name in libraries we opened; `mlxrs_blas_bind` has the
    // signature declared above (native/blas_gemv.c) and only stores the two pointers, which stay
    // valid because neither library is ever closed.
    unsafe {
        let (Ok(gemm), Ok(gemv), Ok(bind)) = (
            blas.get::<*mut std::ffi::c_void>(b"cblas_sgemm\0"),
            blas.get::<*mut std::ffi::c_void>(b"cblas_sgemv\0"),
            router.get::<Bind>(b"mlxrs_blas_bind\0"),
        ) else {
            return;
        };
        bind(*gemm, *gemv);
    }
}

/// The file a bare soname resolved to, read back from /proc/self/maps.
fn resolved_path(name: &str) -> PathBuf {
    let base = Path::new(name).file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
    mapped_files()
        .into_iter()
        .find(|p| p.contains(base.trim_end_matches(".0").trim_end_matches(".so")))
        .map_or_else(|| PathBuf::from(name), PathBuf::from)
}

#[cfg(unix)]
fn open_global(p: &Path) -> Result<libloading::Library, String> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading a shared library runs its initialisers; these are MLX, mlx-c and BLAS, whose
    // initialisers have no preconditions.
    unsafe { Library::open(Some(p), RTLD_NOW | RTLD_GLOBAL) }.map(Into::into).map_err(|e| e.to_string())
}

#[cfg(unix)]
fn open_local(p: &Path) -> Result<libloading::Library, String> {
    use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
    // SAFETY: as for open_global (a BLAS library).
    unsafe { Library::open(Some(p), RTLD_NOW | RTLD_LOCAL) }.map(Into::into).map_err(|e| e.to_string())
}

#[cfg(not(unix))]
fn open_local(p: &Path) -> Result<libloading::Library, String> {
    open_global(p)
}

#[cfg(not(unix))]
fn open_global(p: &Path) -> Result<libloading::Library, String> {
    unsafe { libloading::Library::new(p) }.map_err(|e| e.to_string())
}

/// The directory of the binary or shared object this crate is linked into (the extension module).
#[cfg(unix)]
pub fn this_module_dir() -> Option<PathBuf> {
    #[repr(C)]
    struct DlInfo {
        dli_fname: *const std::os::raw::c_char,
        dli_fbase: *mut std::ffi::c_void,
        dli_sname: *const std::os::raw::c_char,
        dli_saddr: *mut std::ffi::c_void,
    }
    extern "C" {
        fn dladdr(addr: *const std::ffi::c_void, info: *mut DlInfo) -> std::os::raw::c_int;
    }
    let mut info = DlInfo {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: dladdr only reads the address and fills `info`; the name it returns lives as long as the object.
    let ok = unsafe { dladdr(this_module_dir as *const std::ffi::c_void, &mut info) };
    if ok == 0 || info.dli_fname.is_null() {
        return None;
    }
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) }.to_string_lossy().into_owned();
    let p = std::fs::canonicalize(&name).unwrap_or_else(|_| PathBuf::from(name));
    p.parent().map(Path::to_path_buf)
}

#[cfg(not(unix))]
pub fn this_module_dir() -> Option<PathBuf> {
    None
}

/// `<site>/mlx/lib/libmlx.so` → version from `<site>/mlx-<ver>.dist-info`.
pub fn mlx_version_near(libmlx: &Path) -> Option<String> {
    let site = libmlx.parent()?.parent()?.parent()?;
    std::fs::read_dir(site).ok()?.flatten().find_map(|e| {
        let n = e.file_name().to_string_lossy().into_owned();
        n.strip_prefix("mlx-")
            .and_then(|r| r.strip_suffix(".dist-info"))
            .filter(|v| v.chars().next().is_some_and(|c| c.is_ascii_digit()))
            .map(str::to_string)
    })
}
