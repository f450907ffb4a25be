//! The native pack: the native runtime (libmlxc, libmlx and their companions) as one versioned
//! tarball, unpacked into `<mlxrs home>/native-v<ver>-<os>-<arch>-<backend>/`, the third rung of
//! the resolver (`mlxrs_sys::resolve`). `python -m mlxrs native --fetch` downloads it through
//! [`crate::download`] (resumable) and checks it against the sha256 baked into [`PUBLISHED`].
use crate::download::DownloadError;
use mlxrs_sys::{mlxrs_home, native_pack_dir, LIBMLX, LIBMLXC, NATIVE_PACK_VERSION};
use std::path::PathBuf;

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
        let table = [Published { os: os_name(), arch: std::env::consts::ARCH, backend: "cpu", url: "https://r/p.tgz", sha256: SHA }];
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
    fn names_follow_the_resolver() {
        let home = PathBuf::from("/h");
        let d = native_pack_dir(&home, "cpu");
        assert_eq!(d.file_name().unwrap().to_string_lossy(), format!("native-v{NATIVE_PACK_VERSION}-{}", platform("cpu")));
        assert!(archive_name("cpu").ends_with(&format!("{}.tar.gz", platform("cpu"))));
    }
}
