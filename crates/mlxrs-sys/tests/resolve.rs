//! The resolver, pointed only at temporary directories: `Resolver` values are built by hand (never
//! `Resolver::from_env`), so neither the real home nor the environment is consulted.
use mlxrs_sys::{
    load_with, mlx_version_near, native_pack_dir, version_matches, LoadError, Resolver, Source, LIBMLX, LIBMLXC,
    NATIVE_PACK_VERSION,
};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "mlxrs-resolve-{}-{}-{tag}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    fn dir(&self, rel: &str) -> PathBuf {
        let d = self.0.join(rel);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A file that looks like a library to `find` (which only checks it is a file).
fn fake_lib(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, b"not really a shared library").unwrap();
    p
}

fn bare() -> Resolver {
    Resolver { blas: Some("off".into()), ..Resolver::default() }
}

#[test]
fn env_pointing_at_a_missing_file_names_that_file() {
    let t = TempDir::new("env-missing");
    let missing = t.0.join("nowhere").join(LIBMLXC);
    // even with a usable sidecar, an explicit MLXRS_LIBMLXC that is wrong is an error, not a fallback
    let sidecar = t.dir("sidecar");
    fake_lib(&sidecar, LIBMLXC);
    let r = Resolver { env_libmlxc: Some(missing.clone()), sidecar_dir: Some(sidecar), ..bare() };
    let err = r.find().unwrap_err();
    match &err {
        LoadError::EnvMissing { path } => assert_eq!(path, &missing),
        other => panic!("expected EnvMissing, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains(&missing.display().to_string()), "{msg}");
    assert!(msg.contains("MLXRS_LIBMLXC"), "{msg}");
    // load_with reports the same thing
    let err = load_with(&r).unwrap_err();
    assert!(matches!(err, LoadError::EnvMissing { .. }), "{err}");
    assert!(err.to_string().contains(&missing.display().to_string()));
}

#[test]
fn env_pointing_at_a_directory_is_missing_too() {
    let t = TempDir::new("env-dir");
    let d = t.dir(LIBMLXC); // a directory with the library's name is not a library
    let r = Resolver { env_libmlxc: Some(d.clone()), ..bare() };
    assert!(matches!(r.find(), Err(LoadError::EnvMissing { path }) if path == d));
}

#[test]
fn env_wins_over_every_other_rung() {
    let t = TempDir::new("env-wins");
    let mine = fake_lib(&t.dir("mine"), LIBMLXC);
    let sidecar = t.dir("sidecar");
    fake_lib(&sidecar, LIBMLXC);
    let pack = t.dir("pack");
    fake_lib(&pack, LIBMLXC);
    let r = Resolver { env_libmlxc: Some(mine.clone()), sidecar_dir: Some(sidecar), pack_dirs: vec![pack], ..bare() };
    assert_eq!(r.find().unwrap(), (Source::Env, mine));
}

#[test]
fn sidecar_wins_over_the_native_pack_cache() {
    let t = TempDir::new("sidecar-wins");
    let sidecar = t.dir("site-packages/mlxrs");
    let pack = t.dir("home/native-pack");
    let sys_dir = t.dir("homebrew/lib");
    let want = fake_lib(&sidecar, LIBMLXC);
    fake_lib(&pack, LIBMLXC);
    fake_lib(&sys_dir, LIBMLXC);
    let r = Resolver {
        sidecar_dir: Some(sidecar),
        pack_dirs: vec![pack.clone()],
        system_dirs: vec![sys_dir.clone()],
        ..bare()
    };
    assert_eq!(r.find().unwrap(), (Source::Sidecar, want));

    // without the sidecar file, the pack is next; without the pack, the system prefix
    let r = Resolver { sidecar_dir: Some(t.dir("empty-sidecar")), ..r };
    assert_eq!(r.find().unwrap(), (Source::NativePack, pack.join(LIBMLXC)));
    let r = Resolver { pack_dirs: vec![t.dir("empty-pack")], ..r };
    assert_eq!(r.find().unwrap(), (Source::Homebrew, sys_dir.join(LIBMLXC)));
}

#[test]
fn pack_dirs_are_tried_in_order() {
    let t = TempDir::new("pack-order");
    let cuda = t.dir("native-cuda");
    let cpu = t.dir("native-cpu");
    fake_lib(&cpu, LIBMLXC);
    let r = Resolver { pack_dirs: vec![cuda.clone(), cpu.clone()], ..bare() };
    assert_eq!(r.find().unwrap(), (Source::NativePack, cpu.join(LIBMLXC)));
    fake_lib(&cuda, LIBMLXC);
    assert_eq!(r.find().unwrap(), (Source::NativePack, cuda.join(LIBMLXC)));
}

#[test]
fn nothing_found_lists_every_place_and_both_escapes() {
    let t = TempDir::new("not-found");
    let sidecar = t.dir("sidecar");
    let packs = vec![t.dir("pack-cuda"), t.dir("pack-cpu")];
    let systems = vec![t.dir("opt-homebrew-lib"), t.dir("usr-local-lib")];
    let r = Resolver {
        sidecar_dir: Some(sidecar.clone()),
        pack_dirs: packs.clone(),
        system_dirs: systems.clone(),
        ..bare()
    };
    let err = r.find().unwrap_err();
    let LoadError::NotFound { tried } = &err else { panic!("expected NotFound, got {err:?}") };
    // one entry for the unset variable, then every directory in search order
    assert_eq!(tried.len(), 1 + 1 + packs.len() + systems.len(), "{tried:?}");
    let msg = err.to_string();
    let mut last = 0;
    for place in std::iter::once(&sidecar).chain(&packs).chain(&systems) {
        let p = place.join(LIBMLXC).display().to_string();
        let at = msg.find(&p).unwrap_or_else(|| panic!("{p} not in:\n{msg}"));
        assert!(at >= last, "places out of order in:\n{msg}");
        last = at;
    }
    assert!(msg.contains("sidecar:"), "{msg}");
    assert!(msg.contains("native-pack cache:"), "{msg}");
    assert!(msg.contains("homebrew:"), "{msg}");
    // the two ways out
    assert!(msg.contains("MLXRS_LIBMLXC=/path/to/"), "{msg}");
    assert!(msg.contains("python -m mlxrs native --fetch"), "{msg}");
    assert!(msg.contains("MLXRS_NATIVE_PACK_URL"), "{msg}");
    // load_with fails the same way and loads nothing
    assert!(matches!(load_with(&r), Err(LoadError::NotFound { .. })));
}

#[test]
fn nothing_configured_at_all_still_explains() {
    let err = bare().find().unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("MLXRS_LIBMLXC (not set)"), "{msg}");
    assert!(msg.contains("python -m mlxrs native --fetch"), "{msg}");
}

#[test]
fn a_file_that_is_not_a_library_is_an_open_error_naming_it() {
    let t = TempDir::new("garbage");
    let lib = fake_lib(&t.dir("env"), LIBMLXC);
    let r = Resolver { env_libmlxc: Some(lib.clone()), ..bare() };
    let err = load_with(&r).unwrap_err();
    match &err {
        LoadError::Open { path, detail } => {
            assert_eq!(path, &lib);
            // no libmlx beside it nor in the (empty) mlx lib dirs: the hint says so
            assert!(detail.contains("libmlx was not found"), "{detail}");
        }
        other => panic!("expected Open, got {other:?}"),
    }
    assert!(err.to_string().contains(&lib.display().to_string()));
    // the process-wide runtime stayed unloaded
    assert!(mlxrs_sys::runtime().is_none());
}

#[test]
fn libmlx_is_found_beside_then_pip_layout_then_extra_dirs() {
    let t = TempDir::new("libmlx");
    let mlxrs_dir = t.dir("site-packages/mlxrs");
    let libmlxc = fake_lib(&mlxrs_dir, LIBMLXC);
    let extra = t.dir("extra");
    let r = Resolver { mlx_lib_dirs: vec![extra.clone()], ..bare() };
    assert_eq!(r.find_libmlx(&libmlxc), None);
    let extra_lib = fake_lib(&extra, LIBMLX);
    assert_eq!(r.find_libmlx(&libmlxc), Some(extra_lib));
    let pip_dir = t.dir("site-packages/mlx/lib");
    let pip_lib = fake_lib(&pip_dir, LIBMLX);
    assert_eq!(r.find_libmlx(&libmlxc), Some(pip_lib));
    let beside = fake_lib(&mlxrs_dir, LIBMLX);
    assert_eq!(r.find_libmlx(&libmlxc), Some(beside));
}

#[test]
fn version_matching() {
    for (reported, want) in [
        ("0.5.0", "0.5.0"),
        ("0.5.0.dev20250101", "0.5.0"),
        ("0.5.0-rc1", "0.5.0"),
        ("0.5.0+local", "0.5.0"),
        ("0.30.6", "0.30.6"),
        ("0.30.6.dev1+g123", "0.30.6"),
    ] {
        assert!(version_matches(reported, want), "{reported} should match {want}");
    }
    for (reported, want) in [
        ("0.5.1", "0.5.0"),
        ("0.5.01", "0.5.0"),
        ("0.5", "0.5.0"),
        ("0.30.60", "0.30.6"),
        ("10.5.0", "0.5.0"),
        ("", "0.5.0"),
        ("unknown", "0.5.0"),
        ("v0.5.0", "0.5.0"),
    ] {
        assert!(!version_matches(reported, want), "{reported} should not match {want}");
    }
}

#[test]
fn mlx_version_is_read_from_the_dist_info_beside_the_package() {
    let t = TempDir::new("dist-info");
    let site = t.dir("lib/python3.11/site-packages");
    let lib = fake_lib(&t.dir("lib/python3.11/site-packages/mlx/lib"), LIBMLX);
    assert_eq!(mlx_version_near(&lib), None);
    // other distributions whose names start with mlx do not count
    t.dir("lib/python3.11/site-packages/mlx_lm-0.30.6.dist-info");
    t.dir("lib/python3.11/site-packages/mlx_cuda-0.30.6.dist-info");
    t.dir("lib/python3.11/site-packages/mlx-metal.dist-info");
    assert_eq!(mlx_version_near(&lib), None);
    std::fs::create_dir_all(site.join("mlx-0.30.6.dist-info")).unwrap();
    assert_eq!(mlx_version_near(&lib).as_deref(), Some("0.30.6"));
    // a path too short to have a site-packages above it
    assert_eq!(mlx_version_near(Path::new("/libmlx.so")), None);
}

#[test]
fn native_pack_dir_names_version_platform_and_backend() {
    let t = TempDir::new("pack-name");
    let d = native_pack_dir(&t.0, "cpu");
    assert_eq!(d.parent(), Some(t.0.as_path()));
    let name = d.file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with(&format!("native-v{NATIVE_PACK_VERSION}-")), "{name}");
    assert!(name.ends_with(&format!("-{}-cpu", std::env::consts::ARCH)), "{name}");
    assert_ne!(native_pack_dir(&t.0, "cuda"), d);
}

#[test]
fn sources_display_as_the_rung_names() {
    assert_eq!(Source::Env.to_string(), "MLXRS_LIBMLXC");
    assert_eq!(Source::Sidecar.to_string(), "sidecar");
    assert_eq!(Source::NativePack.to_string(), "native-pack cache");
    assert_eq!(Source::Homebrew.to_string(), "homebrew");
}
