//! The native pack: the native runtime (libmlxc, libmlx and their companions) as one versioned
//! tarball, unpacked into `<mlxrs home>/native-v<ver>-<os>-<arch>-<backend>/`, the third place the
//! resolver looks (`mlxrs_sys::Resolver`). [`load`] fetches it on first need: when nothing is found
//! at `MLXRS_LIBMLXC`, beside the extension or in the pack cache, and a source is known (the
//! release URL and sha256 baked into [`PUBLISHED`], or [`URL_ENV`] with a checksum), it is
//! downloaded through [`crate::download`] (resumable, sha256-verified, progress on stderr),
//! unpacked atomically by [`install`] and loaded from there, before Homebrew is tried (as the
//! resolution order puts the cache before Homebrew). `python -m mlxrs native --fetch` runs the
//! same [`install`].
use crate::download::{self, DownloadError, Expected, Outcome, TextProgress};
use crate::error::Error;
use mlxrs_sys::{mlxrs_home, native_pack_dir, LoadError, Resolver, Runtime, LIBMLX, LIBMLXC, NATIVE_PACK_VERSION};
use std::fs::File;
use std::path::{Component, Path, PathBuf};

/// One published pack: where a release put it and its sha256.
#[derive(Clone, Copy, Debug)]
pub struct Published {
    /// `linux` or `macos` (as in the pack directory's name).
    pub os: &'static str,
    /// `std::env::consts::ARCH`: `x86_64`, `aarch64`.
    pub arch: &'static str,
    /// `cpu`, `cuda` or `metal`.
    pub backend: &'static str,
    pub url: &'static str,
    /// sha256 of the tarball, lowercase hex.
    pub sha256: &'static str,
}

/// The packs published for [`NATIVE_PACK_VERSION`], one line per platform, each with the URL and
/// sha256 of its tarball (`mlxrs-native-v<ver>-<os>-<arch>-<backend>.tar.gz`). A release that
/// publishes packs adds their lines here, so that every build carries the checksums it trusts;
/// a platform without a line gets [`DownloadError::NotPublished`]. None is published yet.
pub const PUBLISHED: &[Published] = &[];

/// The environment variable naming another tarball URL (a mirror, or a pack of your own).
pub const URL_ENV: &str = "MLXRS_NATIVE_PACK_URL";
/// The sha256 the tarball at [`URL_ENV`] must have (needed when no checksum is baked in).
pub const SHA256_ENV: &str = "MLXRS_NATIVE_PACK_SHA256";

/// `linux` or `macos`, as in the pack directory's name.
pub fn os_name() -> &'static str {
    if cfg!(target_os = "macos") {
        "macos"
    } else {
        std::env::consts::OS
    }
}

/// `<os>-<arch>-<backend>`, e.g. `linux-x86_64-cpu`.
pub fn platform(backend: &str) -> String {
    format!("{}-{}-{backend}", os_name(), std::env::consts::ARCH)
}

/// The tarball's file name.
pub fn archive_name(backend: &str) -> String {
    format!("mlxrs-native-v{NATIVE_PACK_VERSION}-{}.tar.gz", platform(backend))
}

/// Files an unpacked pack must hold (companions such as other shared libraries may follow).
pub fn required_files(backend: &str) -> Vec<&'static str> {
    let mut v = vec![LIBMLXC, LIBMLX];
    if backend == "metal" {
        v.push("mlx.metallib");
    }
    v
}

/// The pack for this machine when none is named: `metal` on macOS; on Linux `MLXRS_BACKEND`
/// (`cuda` or `cpu`), else `cuda` when an NVIDIA driver is loaded, else `cpu`.
pub fn default_backend() -> &'static str {
    if cfg!(target_os = "macos") {
        return "metal";
    }
    match std::env::var("MLXRS_BACKEND").ok().as_deref() {
        Some("cuda") => "cuda",
        Some("cpu") => "cpu",
        _ if std::path::Path::new("/proc/driver/nvidia/version").exists() => "cuda",
        _ => "cpu",
    }
}

/// Where the pack for `backend` is unpacked (`$MLXRS_HOME`, else `~/.cache/mlxrs`).
pub fn dir(backend: &str) -> Option<PathBuf> {
    mlxrs_home().map(|h| native_pack_dir(&h, backend))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// [`URL_ENV`].
    Env,
    /// A line of [`PUBLISHED`].
    Release,
}

/// Where to fetch the pack from and what it must hash to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Source {
    pub url: String,
    pub sha256: String,
    pub origin: Origin,
}

/// The source for `backend` on this machine, from the environment and [`PUBLISHED`].
pub fn source(backend: &str) -> Result<Source, DownloadError> {
    let var = |k: &str| std::env::var(k).ok().map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
    source_from(backend, var(URL_ENV), var(SHA256_ENV), PUBLISHED)
}

/// [`source`] with its inputs explicit: a URL from the environment wins (checked against
/// `env_sha256`, else the baked checksum for this platform); otherwise the published pack.
pub fn source_from(
    backend: &str,
    env_url: Option<String>,
    env_sha256: Option<String>,
    table: &[Published],
) -> Result<Source, DownloadError> {
    let plat = platform(backend);
    let baked = table.iter().find(|p| p.os == os_name() && p.arch == std::env::consts::ARCH && p.backend == backend);
    match (env_url, baked) {
        (Some(url), _) => {
            let sha256 = env_sha256.map(|s| s.to_ascii_lowercase()).or_else(|| baked.map(|p| p.sha256.to_string()));
            let sha256 = sha256.ok_or_else(|| {
                DownloadError::Invalid(format!(
                    "{URL_ENV} is set but no checksum is known for the {plat} pack: set {SHA256_ENV} to the \
                     tarball's sha256 (`sha256sum` prints it)"
                ))
            })?;
            Ok(Source { url, sha256, origin: Origin::Env })
        }
        (None, Some(p)) => Ok(Source { url: p.url.to_string(), sha256: p.sha256.to_string(), origin: Origin::Release }),
        (None, None) => Err(DownloadError::NotPublished(plat)),
    }
}

/// `MLXRS_DOWNLOAD_RETRIES` (default 5): failed attempts in a row tolerated per transfer.
pub fn retries_from_env() -> Result<u32, DownloadError> {
    let v = std::env::var("MLXRS_DOWNLOAD_RETRIES").unwrap_or_default();
    let v = v.trim();
    if v.is_empty() {
        return Ok(5);
    }
    v.parse()
        .map_err(|_| DownloadError::Invalid(format!("MLXRS_DOWNLOAD_RETRIES must be a whole number >= 0 (got {v:?})")))
}

/// The files of `files` that `dir` lacks.
pub fn missing(dir: &Path, files: &[&str]) -> Vec<String> {
    files.iter().filter(|f| !dir.join(f).is_file()).map(|f| f.to_string()).collect()
}

/// What [`install`] did.
#[derive(Clone, Debug)]
pub struct Installed {
    /// The pack directory.
    pub dir: PathBuf,
    /// The transfer, when the pack was fetched (None: it was already complete).
    pub fetched: Option<Outcome>,
}

/// Hooks for [`install`]: progress of the transfer (`(done, total)`, false cancels), and a call
/// when another process holds the pack's lock and this one waits for it.
pub struct Hooks<'a> {
    pub progress: &'a mut dyn FnMut(u64, u64) -> bool,
    pub waiting: &'a mut dyn FnMut(),
}

/// Fetch, verify and unpack the pack for `backend` from `src` into [`dir`], unless it is already
/// complete (or `force`). One process at a time per pack (`<home>/.locks/<dir name>.lock`, the
/// `flock` python/mlxrs/download.py's `file_lock` takes). The tarball streams into
/// `<home>/<archive>.incomplete` (resumed by the next run when a transfer breaks off), is checked
/// against `src.sha256`, unpacked into a temporary directory beside the pack and renamed into
/// place, so the pack directory is either absent, the old one, or complete.
pub fn install(backend: &str, src: &Source, force: bool, hooks: Hooks<'_>) -> Result<Installed, DownloadError> {
    let dir = dir(backend)
        .ok_or_else(|| DownloadError::Invalid("mlxrs has no cache directory: set MLXRS_HOME (or HOME)".into()))?;
    let files = required_files(backend);
    if !force && missing(&dir, &files).is_empty() {
        return Ok(Installed { dir, fetched: None });
    }
    let home = dir.parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("."));
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let locks = home.join(".locks");
    std::fs::create_dir_all(&locks).map_err(|e| DownloadError::Io { path: locks.clone(), source: e })?;
    let lock_path = locks.join(format!("{name}.lock"));
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| DownloadError::Io { path, source }
    };
    let lock =
        File::options().read(true).write(true).create(true).truncate(false).open(&lock_path).map_err(io(&lock_path))?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            (hooks.waiting)();
            lock.lock().map_err(io(&lock_path))?;
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(io(&lock_path)(e)),
    }
    // another process may have installed it while this one waited
    if !force && missing(&dir, &files).is_empty() {
        return Ok(Installed { dir, fetched: None });
    }
    let archive_name = archive_name(backend);
    let archive = home.join(&archive_name);
    let mut req = download::Request::new(&src.url, &archive, Expected::Sha256(src.sha256.clone()));
    req.name = archive_name.clone();
    req.retries = retries_from_env()?;
    let outcome = download::fetch(&req, hooks.progress)?;
    let tmp = home.join(format!(".{name}.tmp{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let placed = (|| {
        std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
        unpack(&archive, &tmp).map_err(|detail| {
            DownloadError::BadPack(format!("{archive_name} verified but could not be unpacked: {detail}"))
        })?;
        let root = pack_root(&tmp, files[0]);
        let lacking = missing(&root, &files);
        if !lacking.is_empty() {
            return Err(DownloadError::BadPack(format!(
                "the native pack {archive_name} verified but lacks {}; it is not a pack for {}",
                lacking.join(", "),
                platform(backend)
            )));
        }
        let old = home.join(format!(".{name}.old{}", std::process::id()));
        if dir.symlink_metadata().is_ok() {
            std::fs::rename(&dir, &old).map_err(io(&dir))?;
        }
        std::fs::rename(&root, &dir).map_err(io(&dir))?;
        let _ = std::fs::remove_dir_all(&old);
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&tmp);
    let _ = std::fs::remove_file(&archive);
    placed?;
    drop(lock);
    Ok(Installed { dir, fetched: Some(outcome) })
}

/// The directory holding libmlxc: the top of the archive, or its single top-level directory.
fn pack_root(tmp: &Path, first: &str) -> PathBuf {
    if tmp.join(first).exists() {
        return tmp.to_path_buf();
    }
    let entries: Vec<PathBuf> =
        std::fs::read_dir(tmp).map(|rd| rd.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    match entries.as_slice() {
        [one] if one.is_dir() => one.clone(),
        _ => tmp.to_path_buf(),
    }
}

/// `p` as plain components (no root, no `..`), or None when it could leave the directory.
fn inside(p: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            Component::ParentDir | Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

/// Unpack the gzipped tarball `archive` into `dest`: regular files, directories, and symbolic links
/// that stay inside `dest`; anything else (a path or link leading out, a device, a hard link) is
/// refused.
fn unpack(archive: &Path, dest: &Path) -> Result<(), String> {
    let f = File::open(archive).map_err(|e| e.to_string())?;
    let mut ar = tar::Archive::new(flate2::read::GzDecoder::new(std::io::BufReader::new(f)));
    ar.set_preserve_mtime(false);
    ar.set_preserve_permissions(false);
    for entry in ar.entries().map_err(|e| e.to_string())? {
        let mut e = entry.map_err(|e| e.to_string())?;
        let raw = e.path().map_err(|e| e.to_string())?.into_owned();
        let kind = e.header().entry_type();
        if kind.is_pax_global_extensions() || kind.is_pax_local_extensions() || kind.is_gnu_longname() {
            continue;
        }
        let rel = inside(&raw)
            .ok_or_else(|| format!("it holds a path outside its directory: {:?}", raw.display().to_string()))?;
        if rel.as_os_str().is_empty() {
            continue; // "./"
        }
        let target = dest.join(&rel);
        if kind.is_dir() {
            std::fs::create_dir_all(&target).map_err(|e| e.to_string())?;
            continue;
        }
        if kind.is_symlink() {
            let link = e.link_name().map_err(|e| e.to_string())?.unwrap_or_default().into_owned();
            let resolved = rel.parent().map(|p| p.join(&link)).unwrap_or_else(|| link.clone());
            if link.is_absolute() || !normalizes_inside(&resolved) {
                return Err(format!("it holds a link outside its directory: {:?}", raw.display().to_string()));
            }
        } else if !(kind.is_file() || kind.is_contiguous()) {
            return Err(format!("it holds a special file: {:?}", raw.display().to_string()));
        }
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(|e| e.to_string())?;
        }
        e.unpack(&target).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Whether a relative path, with its `..` applied, stays below its start.
fn normalizes_inside(p: &Path) -> bool {
    let mut depth = 0usize;
    for c in p.components() {
        match c {
            Component::Normal(_) => depth += 1,
            Component::CurDir => {}
            Component::ParentDir if depth > 0 => depth -= 1,
            _ => return false,
        }
    }
    true
}

/// One process at a time through the first-need path (the file lock covers other processes).
static FIRST_NEED: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// `mlxrs_sys::load`, with the native pack fetched on first need: the resolver's order
/// (`MLXRS_LIBMLXC`, sidecar, native-pack cache, Homebrew), except that when the first three hold
/// nothing and a pack source is known for this machine ([`source`] for [`default_backend`]) the
/// pack is fetched into the cache and loaded from there before Homebrew is looked at. With no
/// source, Homebrew is the last place; when it has nothing either the error lists every place
/// tried and the message with both escapes ([`DownloadError::NotPublished`]).
pub fn load() -> Result<&'static Runtime, Error> {
    if let Some(rt) = mlxrs_sys::runtime() {
        return Ok(rt);
    }
    let resolver = Resolver::from_env();
    let tried = match resolver.find() {
        Ok((mlxrs_sys::Source::Homebrew, _)) => Vec::new(),
        Err(LoadError::NotFound { tried }) => tried,
        _ => return Ok(mlxrs_sys::load_with(&resolver)?),
    };
    let _g = FIRST_NEED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(rt) = mlxrs_sys::runtime() {
        return Ok(rt);
    }
    let backend = default_backend();
    let src = match source(backend) {
        Ok(s) => s,
        Err(e) => {
            if tried.is_empty() {
                return Ok(mlxrs_sys::load_with(&resolver)?); // Homebrew has it
            }
            return Err(Error::NoRuntime(not_found(&tried, &e.to_string())));
        }
    };
    let tried = if tried.is_empty() { resolver_tried_before_homebrew(&resolver) } else { tried };
    let dir = dir(backend).unwrap_or_default();
    eprintln!(
        "mlxrs: no native runtime found (MLXRS_LIBMLXC, sidecar, native-pack cache); fetching the native pack {} \
         from {} into {}",
        archive_name(backend),
        src.url,
        dir.display()
    );
    let mut bar = TextProgress::new(archive_name(backend));
    let mut progress = |done: u64, total: u64| bar.update(done, total);
    let mut waiting =
        || eprintln!("mlxrs: another process is fetching the {} native pack; waiting for it", platform(backend));
    let installed = install(backend, &src, false, Hooks { progress: &mut progress, waiting: &mut waiting });
    match installed {
        Ok(Installed { fetched: Some(o), .. }) => {
            bar.finish(if o.resumed_from > 0 { " (resumed)" } else { "" });
            eprintln!("mlxrs: unpacked the native pack into {}", dir.display());
        }
        Ok(Installed { fetched: None, .. }) => {}
        Err(e) => {
            let hint = match (&e, src.origin) {
                (DownloadError::Verify { .. }, Origin::Env) => {
                    format!(" (check that the tarball at {URL_ENV} is the one {SHA256_ENV} describes)")
                }
                _ => String::new(),
            };
            let why = format!("The native pack for {} was not installed: {e}{hint}", platform(backend));
            return Err(Error::NoRuntime(not_found(&tried, &why)));
        }
    }
    // the resolver now finds the pack directory (the third place)
    Ok(mlxrs_sys::load_with(&Resolver::from_env())?)
}

/// The places tried before Homebrew, for a message when Homebrew would have had a libmlxc.
fn resolver_tried_before_homebrew(r: &Resolver) -> Vec<String> {
    let no_brew = Resolver { system_dirs: Vec::new(), ..r.clone() };
    match no_brew.find() {
        Err(LoadError::NotFound { tried }) => tried,
        _ => Vec::new(),
    }
}

/// The could-not-find message: every place tried, then `why`.
fn not_found(tried: &[String], why: &str) -> String {
    let mut m =
        format!("mlxrs could not find its native runtime ({LIBMLXC}, mlx-c v{}). Tried:\n", mlxrs_sys::BUILT_FOR_MLXC);
    for t in tried {
        m.push_str(&format!("  - {t}\n"));
    }
    m.push_str(why);
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHA: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn no_published_pack_names_both_escapes() {
        let e = source_from("cpu", None, None, &[]).unwrap_err();
        let msg = e.to_string();
        assert!(msg.starts_with(&format!("no native pack published for {}", platform("cpu"))), "{msg}");
        assert!(msg.contains("set MLXRS_LIBMLXC or install mlx via homebrew"), "{msg}");
    }

    #[test]
    fn a_published_line_is_used_and_an_env_url_overrides_it() {
        let table = [Published {
            os: os_name(),
            arch: std::env::consts::ARCH,
            backend: "cpu",
            url: "https://r/p.tgz",
            sha256: SHA,
        }];
        let s = source_from("cpu", None, None, &table).unwrap();
        assert_eq!((s.url.as_str(), s.sha256.as_str(), s.origin), ("https://r/p.tgz", SHA, Origin::Release));
        // a mirror: the baked checksum still applies
        let s = source_from("cpu", Some("http://m/p.tgz".into()), None, &table).unwrap();
        assert_eq!((s.url.as_str(), s.sha256.as_str(), s.origin), ("http://m/p.tgz", SHA, Origin::Env));
        // another backend has no line
        assert!(matches!(source_from("cuda", None, None, &table), Err(DownloadError::NotPublished(_))));
    }

    #[test]
    fn an_env_url_without_a_checksum_is_refused() {
        let e = source_from("cpu", Some("http://m/p.tgz".into()), None, &[]).unwrap_err();
        assert!(e.to_string().contains("MLXRS_NATIVE_PACK_SHA256"), "{e}");
        let s = source_from("cpu", Some("http://m/p.tgz".into()), Some(SHA.to_uppercase()), &[]).unwrap();
        assert_eq!(s.sha256, SHA);
    }

    #[test]
    fn unpacked_paths_and_links_stay_inside() {
        assert_eq!(inside(Path::new("./a/b.so")), Some(PathBuf::from("a/b.so")));
        assert_eq!(inside(Path::new("../escaped")), None);
        assert_eq!(inside(Path::new("/etc/passwd")), None);
        assert_eq!(inside(Path::new("a/../../b")), None);
        assert!(normalizes_inside(Path::new("dir/../libmlx.so")));
        assert!(!normalizes_inside(Path::new("dir/../../libmlx.so")));
        assert!(!normalizes_inside(Path::new("/usr/lib/libmlx.so")));
    }

    #[test]
    fn names_follow_the_resolver() {
        let home = PathBuf::from("/h");
        let d = native_pack_dir(&home, "cpu");
        assert_eq!(
            d.file_name().unwrap().to_string_lossy(),
            format!("native-v{NATIVE_PACK_VERSION}-{}", platform("cpu"))
        );
        assert!(archive_name("cpu").ends_with(&format!("{}.tar.gz", platform("cpu"))));
    }
}
