//! Resumable, verified HTTP(S) transfer: the one piece of code behind `python -m mlxrs get`
//! (Hugging Face files) and the native-pack download ([`crate::native_pack`]).
//!
//! A file streams into `<dest>.incomplete`; when that file already exists the transfer resumes
//! with `Range: bytes=<len>-`. The content is hashed while it streams (a prefix left by an earlier
//! run is re-read from disk, never fetched again) and renamed to `<dest>` only once its sha256
//! (LFS files, packs) or git blob sha1 (small files of a git repo) and its size match. A mismatch
//! drops the bytes and fetches the file once more from the start; a second mismatch is an error
//! naming the file. A connection that drops is resumed where it stopped, up to `retries` times in
//! a row without progress; after that the partial file stays for the next run.
use sha1::{Digest as _, Sha1};
use sha2::Sha256;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// What the complete file must hash to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expected {
    /// sha256 of the content, lowercase hex (Git LFS files, native packs).
    Sha256(String),
    /// The git blob id: sha1 of `blob <size>\0` followed by the content, lowercase hex (the
    /// small, non-LFS files of a Hugging Face repo). Needs the size up front.
    GitBlobSha1(String),
}

impl Expected {
    pub fn algorithm(&self) -> &'static str {
        match self {
            Expected::Sha256(_) => "sha256",
            Expected::GitBlobSha1(_) => "git-blob sha1",
        }
    }

    pub fn hex(&self) -> &str {
        match self {
            Expected::Sha256(h) | Expected::GitBlobSha1(h) => h,
        }
    }

    fn validate(&self) -> Result<(), DownloadError> {
        let (h, n) = match self {
            Expected::Sha256(h) => (h, 64),
            Expected::GitBlobSha1(h) => (h, 40),
        };
        if h.len() != n || !h.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            return Err(DownloadError::Invalid(format!(
                "expected {} must be {n} lowercase hex digits, got {h:?}",
                self.algorithm()
            )));
        }
        Ok(())
    }
}

/// How an authorization or not-found answer is explained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Advice {
    /// A Hugging Face repo file: tokens come from `hf auth login` or `HF_TOKEN`.
    HuggingFace,
    /// Any other URL (the native pack).
    Plain,
}

/// One file to fetch.
#[derive(Clone, Debug)]
pub struct Request {
    pub url: String,
    /// Where the verified file ends up; the partial file is `<dest>.incomplete`.
    pub dest: PathBuf,
    pub expected: Expected,
    /// The size the file must have, when known (required for [`Expected::GitBlobSha1`]).
    pub size: Option<u64>,
    /// The name used in messages (the repo file name, the pack's archive name).
    pub name: String,
    /// Sent as `Authorization: Bearer <token>` (dropped on a redirect to another host).
    pub token: Option<String>,
    pub advice: Advice,
    /// Failed attempts in a row (no byte received) tolerated before giving up.
    pub retries: u32,
    /// The wait before the first retry; it doubles with each failure in a row (at most 10 s).
    pub backoff: Duration,
}

impl Request {
    pub fn new(url: impl Into<String>, dest: impl Into<PathBuf>, expected: Expected) -> Self {
        let dest = dest.into();
        let name = dest.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        Request {
            url: url.into(),
            dest,
            expected,
            size: None,
            name,
            token: None,
            advice: Advice::Plain,
            retries: 5,
            backoff: Duration::from_millis(500),
        }
    }
}

/// What a successful [`fetch`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Body bytes received over the network (both fetches, when there was a refetch).
    pub transferred: u64,
    /// Length of the `.incomplete` prefix from an earlier run that was kept (0: none).
    pub resumed_from: u64,
    /// A verification failure made the file be fetched again from the start.
    pub refetched: bool,
    /// The verified file's size.
    pub size: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum DownloadError {
    /// The server answered with an error status; the message says what to do.
    #[error("{message}")]
    Http { status: u16, url: String, message: String },
    /// The connection kept failing; the partial file is kept for the next run.
    #[error("{}", network_message(name, url, detail, *done, partial))]
    Network { name: String, url: String, detail: String, done: u64, partial: PathBuf },
    /// The file did not verify, twice.
    #[error(
        "{name} failed verification twice (from {url}): expected {algorithm} {expected}, got {got}. \
         The bad bytes were dropped; the server (or something between it and you) sends different content \
         than the repo's metadata describes"
    )]
    Verify { name: String, url: String, algorithm: &'static str, expected: String, got: String },
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{0}")]
    Invalid(String),
    /// No pack is published for this platform (`<os>-<arch>-<backend>`): the two escapes.
    #[error(
        "no native pack published for {0} — set MLXRS_LIBMLXC or install mlx via homebrew \
         (or point MLXRS_NATIVE_PACK_URL and MLXRS_NATIVE_PACK_SHA256 at a pack of your own)"
    )]
    NotPublished(String),
    /// A native pack verified but is not usable (it cannot be unpacked, or lacks a library).
    #[error("{0}")]
    BadPack(String),
    /// The progress callback asked to stop; the partial file is kept.
    #[error("download of {0} cancelled; the partial file is kept and the next run resumes it")]
    Cancelled(String),
}

fn network_message(name: &str, url: &str, detail: &str, done: u64, partial: &Path) -> String {
    if done == 0 {
        return format!("{name}: download from {url} failed: {detail}");
    }
    format!(
        "{name}: download from {url} failed: {detail}; the {done} bytes received so far are kept in {} — \
         run the same command again to resume",
        partial.display()
    )
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> DownloadError + '_ {
    move |source| DownloadError::Io { path: path.to_path_buf(), source }
}

/// `<dest>.incomplete`: where a file lives while it is being fetched.
pub fn incomplete_path(dest: &Path) -> PathBuf {
    let mut s = dest.as_os_str().to_owned();
    s.push(".incomplete");
    PathBuf::from(s)
}

enum Hasher {
    Sha256(Sha256),
    Sha1(Sha1),
}

impl Hasher {
    fn new(expected: &Expected, size: Option<u64>) -> Result<Self, DownloadError> {
        Ok(match expected {
            Expected::Sha256(_) => Hasher::Sha256(Sha256::new()),
            Expected::GitBlobSha1(_) => {
                let size = size.ok_or_else(|| {
                    DownloadError::Invalid("a git blob sha1 can only be checked when the size is known".into())
                })?;
                let mut h = Sha1::new();
                h.update(format!("blob {size}\0").as_bytes());
                Hasher::Sha1(h)
            }
        })
    }

    fn update(&mut self, b: &[u8]) {
        match self {
            Hasher::Sha256(h) => h.update(b),
            Hasher::Sha1(h) => h.update(b),
        }
    }

    fn hex(self) -> String {
        let bytes: Vec<u8> = match self {
            Hasher::Sha256(h) => h.finalize().to_vec(),
            Hasher::Sha1(h) => h.finalize().to_vec(),
        };
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// Hash a file on disk the way [`fetch`] checks it (sha256, or git blob sha1 with its size).
pub fn hash_file(path: &Path, git_blob: bool) -> Result<String, DownloadError> {
    let size = std::fs::metadata(path).map_err(io_err(path))?.len();
    let expected = if git_blob { Expected::GitBlobSha1(String::new()) } else { Expected::Sha256(String::new()) };
    let mut h = Hasher::new(&expected, Some(size))?;
    let mut f = File::open(path).map_err(io_err(path))?;
    hash_prefix(&mut f, size, &mut h).map_err(io_err(path))?;
    Ok(h.hex())
}

fn hash_prefix(f: &mut File, len: u64, h: &mut Hasher) -> std::io::Result<()> {
    f.seek(SeekFrom::Start(0))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut left = len;
    while left > 0 {
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let n = f.read(&mut buf[..want])?;
        if n == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "file shrank while being read"));
        }
        h.update(&buf[..n]);
        left -= n as u64;
    }
    Ok(())
}

/// One shared agent: proxies from the environment (`HTTPS_PROXY`, `NO_PROXY`, …), redirects
/// followed (the token only to the same host), roots from `SSL_CERT_FILE` when it is set, else
/// the bundled Mozilla roots.
fn agent() -> &'static ureq::Agent {
    static AGENT: std::sync::OnceLock<ureq::Agent> = std::sync::OnceLock::new();
    AGENT.get_or_init(|| {
        let mut cfg = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .user_agent(format!("mlxrs/{}", env!("CARGO_PKG_VERSION")))
            .redirect_auth_headers(ureq::config::RedirectAuthHeaders::SameHost)
            .max_redirects(10)
            .timeout_connect(Some(Duration::from_secs(30)))
            .timeout_recv_response(Some(Duration::from_secs(120)))
            .timeout_per_read(Some(Duration::from_secs(120)));
        if let Some(roots) = roots_from_env() {
            cfg = cfg.tls_config(ureq::tls::TlsConfig::builder().root_certs(roots).build());
        }
        cfg.build().into()
    })
}

fn roots_from_env() -> Option<ureq::tls::RootCerts> {
    let path = std::env::var_os("SSL_CERT_FILE")?;
    let pem = std::fs::read(path).ok()?;
    let certs: Vec<_> = ureq::tls::parse_pem(&pem)
        .filter_map(|item| match item {
            Ok(ureq::tls::PemItem::Certificate(c)) => Some(c),
            _ => None,
        })
        .collect();
    (!certs.is_empty()).then(|| ureq::tls::RootCerts::new_with_certs(&certs))
}

fn host_of(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    rest.split(['/', '?', '#']).next().unwrap_or(rest)
}

fn http_error(req: &Request, status: u16, server_says: Option<String>) -> DownloadError {
    let host = host_of(&req.url);
    let said = server_says.filter(|s| !s.is_empty()).map(|s| format!(" (server: {s})")).unwrap_or_default();
    let has_token = req.token.is_some();
    let what = match (status, req.advice) {
        (401, Advice::HuggingFace) if has_token => {
            "the token sent was refused (expired or revoked?): run `hf auth login` again, or export a valid HF_TOKEN"
                .to_string()
        }
        (401, Advice::HuggingFace) => {
            "this repo needs a Hugging Face token and none was found: run `hf auth login`, or export HF_TOKEN=hf_…"
                .to_string()
        }
        (403, Advice::HuggingFace) if has_token => "your token has no access to this repo: if it is gated, accept its \
             terms on its page on the Hub with the same account, and make sure the token (`hf auth login` or HF_TOKEN) \
             has read access"
            .to_string(),
        (403, Advice::HuggingFace) => {
            "this repo is gated or private and no token was sent: accept its terms on its page \
             on the Hub, then run `hf auth login` or export HF_TOKEN"
                .to_string()
        }
        (401 | 403, Advice::Plain) => "the server refused access to this URL".to_string(),
        (404 | 410, Advice::HuggingFace) => {
            "no such file at this revision: check the repo id, the revision and the file name".to_string()
        }
        (404 | 410, Advice::Plain) => "nothing at this URL".to_string(),
        _ => "the server answered with an error".to_string(),
    };
    let reason = match status {
        401 => "401 Unauthorized",
        403 => "403 Forbidden",
        404 => "404 Not Found",
        410 => "410 Gone",
        416 => "416 Range Not Satisfiable",
        429 => "429 Too Many Requests",
        500 => "500 Internal Server Error",
        502 => "502 Bad Gateway",
        503 => "503 Service Unavailable",
        504 => "504 Gateway Timeout",
        _ => "",
    };
    let status_text = if reason.is_empty() { format!("HTTP {status}") } else { reason.to_string() };
    DownloadError::Http {
        status,
        url: req.url.clone(),
        message: format!("{}: {status_text} from {host}{said} — {what} ({})", req.name, req.url),
    }
}

fn retryable(status: u16) -> bool {
    matches!(status, 408 | 425 | 429 | 500 | 502 | 503 | 504)
}

/// `bytes <start>-<end>/<total>` or `bytes */<total>` → (start, total).
fn content_range(v: &str) -> (Option<u64>, Option<u64>) {
    let Some(rest) = v.trim().strip_prefix("bytes") else { return (None, None) };
    let rest = rest.trim();
    let (range, total) = rest.split_once('/').unwrap_or((rest, "*"));
    let start = range.split_once('-').and_then(|(s, _)| s.trim().parse().ok());
    (start, total.trim().parse().ok())
}

/// The partial file, hashed as far as it goes.
struct Partial {
    file: File,
    path: PathBuf,
    len: u64,
    hasher: Hasher,
}

impl Partial {
    fn open(req: &Request) -> Result<Self, DownloadError> {
        let path = incomplete_path(&req.dest);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        }
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io_err(&path))?;
        let mut len = file.metadata().map_err(io_err(&path))?.len();
        if req.size.is_some_and(|s| len > s) {
            len = 0; // longer than the file can be: not a prefix of it
        }
        let mut hasher = Hasher::new(&req.expected, req.size)?;
        if len > 0 {
            hash_prefix(&mut file, len, &mut hasher).map_err(io_err(&path))?;
        }
        file.set_len(len).map_err(io_err(&path))?;
        file.seek(SeekFrom::Start(len)).map_err(io_err(&path))?;
        Ok(Partial { file, path, len, hasher })
    }

    fn restart(&mut self, req: &Request) -> Result<(), DownloadError> {
        self.file.set_len(0).map_err(io_err(&self.path))?;
        self.file.seek(SeekFrom::Start(0)).map_err(io_err(&self.path))?;
        self.len = 0;
        self.hasher = Hasher::new(&req.expected, req.size)?;
        Ok(())
    }

    fn append(&mut self, b: &[u8]) -> Result<(), DownloadError> {
        self.file.write_all(b).map_err(io_err(&self.path))?;
        self.hasher.update(b);
        self.len += b.len() as u64;
        Ok(())
    }
}

/// Calls the progress callback at most every 100 ms, and always with `force`.
struct Ticker<'a> {
    cb: &'a mut dyn FnMut(u64, u64) -> bool,
    last: Option<Instant>,
}

impl Ticker<'_> {
    fn tick(&mut self, done: u64, total: u64, force: bool) -> bool {
        let now = Instant::now();
        if !force && self.last.is_some_and(|t| now.duration_since(t) < Duration::from_millis(100)) {
            return true;
        }
        self.last = Some(now);
        (self.cb)(done, total)
    }
}

enum Attempt {
    Done,
    /// Worth retrying: (what went wrong, bytes received in this attempt).
    Failed(String, u64),
    /// Retrying cannot help (a certificate the roots do not vouch for).
    Fatal(String),
}

/// Fetch `req.url` into `req.dest`, resuming and verifying as the module describes.
/// `progress(done, total)` is called as bytes arrive (total 0 while unknown); returning false
/// cancels, keeping the partial file.
pub fn fetch(req: &Request, progress: &mut dyn FnMut(u64, u64) -> bool) -> Result<Outcome, DownloadError> {
    req.expected.validate()?;
    let mut ticker = Ticker { cb: progress, last: None };
    let mut part = Partial::open(req)?;
    let mut out = Outcome { resumed_from: part.len, ..Outcome::default() };
    loop {
        let total = transfer(req, &mut part, &mut ticker, &mut out)?;
        part.file.sync_all().map_err(io_err(&part.path))?;
        let len = part.len;
        let size_ok = !matches!(req.size, Some(s) if s != len) && !matches!(total, Some(t) if t != len);
        let hasher = std::mem::replace(&mut part.hasher, Hasher::new(&req.expected, req.size)?);
        let got = hasher.hex();
        if size_ok && got == req.expected.hex() {
            drop(part.file);
            std::fs::rename(&part.path, &req.dest).map_err(io_err(&req.dest))?;
            out.size = len;
            ticker.tick(len, len, true);
            return Ok(out);
        }
        let remote_size = total.filter(|t| req.size.is_some_and(|s| s != *t));
        let got = match remote_size {
            Some(t) => format!("a {t}-byte file"),
            None if !size_ok => format!("{len} bytes"),
            None => got,
        };
        if out.refetched {
            drop(part.file);
            let _ = std::fs::remove_file(&part.path);
            return Err(DownloadError::Verify {
                name: req.name.clone(),
                url: req.url.clone(),
                algorithm: req.expected.algorithm(),
                expected: match req.size {
                    Some(s) if !size_ok => format!("{s} bytes"),
                    _ => req.expected.hex().to_string(),
                },
                got,
            });
        }
        // drop the bad bytes and fetch the whole file once more
        out.refetched = true;
        out.resumed_from = 0;
        part.restart(req)?;
    }
}

/// Bring the partial file to the end of the remote file, retrying dropped connections. Returns the
/// total size the server announced, when it did.
fn transfer(
    req: &Request,
    part: &mut Partial,
    ticker: &mut Ticker<'_>,
    out: &mut Outcome,
) -> Result<Option<u64>, DownloadError> {
    let mut failures = 0u32;
    let mut announced: Option<u64> = None;
    loop {
        if !ticker.tick(part.len, req.size.or(announced).unwrap_or(0), true) {
            return Err(DownloadError::Cancelled(req.name.clone()));
        }
        if req.size.is_some_and(|s| part.len == s) {
            return Ok(announced);
        }
        match attempt(req, part, ticker, out, &mut announced)? {
            Attempt::Done => return Ok(announced),
            Attempt::Fatal(detail) => return Err(gave_up(req, part, detail)),
            Attempt::Failed(detail, got) => {
                failures = if got > 0 { 1 } else { failures + 1 };
                if failures > req.retries {
                    return Err(gave_up(req, part, detail));
                }
                let wait = req.backoff.saturating_mul(1 << (failures - 1).min(6)).min(Duration::from_secs(10));
                std::thread::sleep(wait);
            }
        }
    }
}

/// The error for a transfer that stops here; an empty partial file is not left behind.
fn gave_up(req: &Request, part: &Partial, detail: String) -> DownloadError {
    if part.len == 0 {
        let _ = std::fs::remove_file(&part.path);
    }
    DownloadError::Network {
        name: req.name.clone(),
        url: req.url.clone(),
        detail,
        done: part.len,
        partial: part.path.clone(),
    }
}

fn attempt(
    req: &Request,
    part: &mut Partial,
    ticker: &mut Ticker<'_>,
    out: &mut Outcome,
    announced: &mut Option<u64>,
) -> Result<Attempt, DownloadError> {
    let mut call = agent().get(&req.url).header("Accept-Encoding", "identity");
    if let Some(t) = &req.token {
        call = call.header("Authorization", format!("Bearer {t}"));
    }
    let offset = part.len;
    if offset > 0 {
        call = call.header("Range", format!("bytes={offset}-"));
    }
    let resp = match call.call() {
        Ok(r) => r,
        Err(e) => {
            let detail = e.to_string();
            if detail.contains("certificate") {
                return Ok(Attempt::Fatal(format!(
                    "{detail} (behind a TLS-inspecting proxy? set SSL_CERT_FILE to a CA bundle that includes its \
                     certificate)"
                )));
            }
            return Ok(Attempt::Failed(detail, 0));
        }
    };
    let status = resp.status().as_u16();
    let header = |name: &str| resp.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
    let (range_start, range_total) = header("content-range").map(|v| content_range(&v)).unwrap_or((None, None));
    match status {
        200 => {
            if offset > 0 {
                part.restart(req)?; // the server ignored the range: take the whole body
            }
            let len = resp.body().content_length();
            *announced = len.or(*announced);
        }
        206 => {
            if range_start != Some(offset) {
                part.restart(req)?;
                return Ok(Attempt::Failed(format!("the server answered a different range ({range_start:?})"), 0));
            }
            *announced = range_total.or(*announced);
        }
        416 if offset > 0 => {
            // the partial file reaches (or passes) the end of the remote file
            if range_total == Some(offset) {
                *announced = range_total;
                return Ok(Attempt::Done);
            }
            part.restart(req)?;
            return Ok(Attempt::Failed("the partial file is longer than the remote one".into(), 0));
        }
        s if retryable(s) => {
            let err = http_error(req, s, header("x-error-message"));
            return Ok(Attempt::Failed(err.to_string(), 0));
        }
        s => {
            if part.len == 0 {
                let _ = std::fs::remove_file(&part.path);
            }
            return Err(http_error(req, s, header("x-error-message")));
        }
    }
    if let (Some(size), Some(total)) = (req.size, *announced) {
        if size != total {
            // the remote file is not the one described: let verification report it
            return Ok(Attempt::Done);
        }
    }
    let mut body = resp.into_body().into_reader();
    let mut buf = vec![0u8; 256 << 10];
    let start = part.len;
    let total = || req.size.or(*announced).unwrap_or(0);
    loop {
        match body.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                part.append(&buf[..n])?;
                out.transferred += n as u64;
                if !ticker.tick(part.len, total(), false) {
                    return Err(DownloadError::Cancelled(req.name.clone()));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Ok(Attempt::Failed(e.to_string(), part.len - start)),
        }
    }
    match (*announced).or(req.size) {
        Some(t) if part.len < t => {
            Ok(Attempt::Failed(format!("the connection closed after {} of {t} bytes", part.len), part.len - start))
        }
        _ => Ok(Attempt::Done),
    }
}

/// `1536` → `1.5 KiB` (as `human` in python/mlxrs/download.py).
pub fn human(n: f64) -> String {
    let mut n = n;
    for unit in ["B", "KiB", "MiB", "GiB"] {
        if n.abs() < 1024.0 {
            return if unit == "B" { format!("{n:.0} B") } else { format!("{n:.1} {unit}") };
        }
        n /= 1024.0;
    }
    format!("{n:.1} TiB")
}

/// Where a transfer made outside Python's own calls (the native pack fetched on first need) reports
/// its progress: `(name, done, total)`. The extension registers one drawing Python's tqdm bar
/// (`mlxrs.download.ByteBar`) so that mlxrs has one progress bar library; Rust draws none itself.
pub type ProgressHook = Box<dyn Fn(&str, u64, u64) + Send + Sync>;

static PROGRESS_HOOK: std::sync::OnceLock<ProgressHook> = std::sync::OnceLock::new();

/// Register the [`ProgressHook`] (once; later calls are ignored).
pub fn set_progress_hook(hook: ProgressHook) {
    let _ = PROGRESS_HOOK.set(hook);
}

/// The progress of one transfer made outside Python: updates go to the registered
/// [`ProgressHook`] (nothing is drawn without one), and [`TextProgress::finish`] prints the file's
/// plain line `  <name>  <size><note>, <rate>/s` on stderr.
pub struct TextProgress {
    name: String,
    t0: Instant,
    /// Bytes present before this run (a resumed prefix): not part of the rate.
    base: Option<u64>,
    done: u64,
}

impl TextProgress {
    pub fn new(name: impl Into<String>) -> Self {
        TextProgress { name: name.into(), t0: Instant::now(), base: None, done: 0 }
    }

    /// The callback for [`fetch`]: records (done, total) and hands it to the hook.
    pub fn update(&mut self, done: u64, total: u64) -> bool {
        self.base.get_or_insert(done);
        self.done = done;
        if let Some(h) = PROGRESS_HOOK.get() {
            h(&self.name, done, total);
        }
        true
    }

    /// The plain line of the finished file.
    pub fn line(&self, note: &str) -> String {
        let dt = self.t0.elapsed().as_secs_f64();
        let got = self.done.saturating_sub(self.base.unwrap_or(0));
        let rate = if dt > 0.0 && got > 0 { format!(", {}/s", human(got as f64 / dt)) } else { String::new() };
        format!("  {}  {}{note}{rate}", self.name, human(self.done as f64))
    }

    /// Print [`TextProgress::line`] on stderr.
    pub fn finish(&mut self, note: &str) {
        let mut err = std::io::stderr().lock();
        let _ = writeln!(err, "{}", self.line(note));
        let _ = err.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead;
    use std::net::TcpListener;
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
    use std::sync::Arc;

    fn sha256_hex(b: &[u8]) -> String {
        Sha256::digest(b).iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn git_blob_sha1_matches_git() {
        // `printf 'hello\n' | git hash-object --stdin`
        let mut h = Hasher::new(&Expected::GitBlobSha1(String::new()), Some(6)).unwrap();
        h.update(b"hello\n");
        assert_eq!(h.hex(), "ce013625030ba8dba906f756967f9e9ca394464a");
    }

    #[test]
    fn the_finished_line_counts_only_this_runs_bytes_in_its_rate() {
        let mut p = TextProgress::new("pack.tar.gz");
        p.update(500, 1000); // a resumed prefix
        assert!(p.line("").starts_with("  pack.tar.gz  500 B"), "{}", p.line(""));
        assert!(!p.line("").contains("/s"), "nothing moved yet: no rate");
        std::thread::sleep(Duration::from_millis(5));
        p.update(1000, 1000);
        let l = p.line(" (resumed)");
        assert!(l.starts_with("  pack.tar.gz  1000 B (resumed), ") && l.ends_with("/s"), "{l}");
    }

    #[test]
    fn human_sizes_read_like_pythons() {
        assert_eq!(human(512.0), "512 B");
        assert_eq!(human(1536.0), "1.5 KiB");
        assert_eq!(human(10_087_293.0), "9.6 MiB");
        assert_eq!(human(3.0 * 1024f64.powi(4)), "3.0 TiB");
    }

    #[test]
    fn content_range_parses() {
        assert_eq!(content_range("bytes 10-19/20"), (Some(10), Some(20)));
        assert_eq!(content_range("bytes */20"), (None, Some(20)));
        assert_eq!(content_range("bytes 0-9/*"), (Some(0), None));
        assert_eq!(content_range("junk"), (None, None));
    }

    #[test]
    fn bad_expected_is_rejected() {
        let r = Request::new("http://127.0.0.1:1/x", "/nonexistent/x", Expected::Sha256("ABC".into()));
        assert!(matches!(fetch(&r, &mut |_, _| true), Err(DownloadError::Invalid(_))));
    }

    /// A one-file HTTP/1.1 server: honours Range, cuts the first response after `cut` bytes when
    /// set, flips a byte in the first `flips` responses, counts the body bytes it sends.
    struct Server {
        url: String,
        sent: Arc<AtomicU64>,
        requests: Arc<AtomicUsize>,
    }

    fn serve(data: Vec<u8>, cut: Option<usize>, flips: usize) -> Server {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/file", l.local_addr().unwrap());
        let sent = Arc::new(AtomicU64::new(0));
        let requests = Arc::new(AtomicUsize::new(0));
        let (s2, r2) = (sent.clone(), requests.clone());
        std::thread::spawn(move || {
            for conn in l.incoming() {
                let Ok(mut c) = conn else { continue };
                let n = r2.fetch_add(1, Ordering::SeqCst);
                let mut rd = std::io::BufReader::new(c.try_clone().unwrap());
                let mut start = 0usize;
                loop {
                    let mut line = String::new();
                    if rd.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                        break;
                    }
                    if let Some(v) = line.to_ascii_lowercase().strip_prefix("range: bytes=") {
                        start = v.trim().trim_end_matches('-').parse().unwrap();
                    }
                }
                let mut body = data[start..].to_vec();
                if n < flips && !body.is_empty() {
                    let i = body.len() / 2;
                    body[i] ^= 0xff;
                }
                let head = if start > 0 {
                    format!(
                        "HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\nContent-Range: bytes {start}-{}/{}\r\nConnection: close\r\n\r\n",
                        body.len(),
                        data.len() - 1,
                        data.len()
                    )
                } else {
                    format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len())
                };
                c.write_all(head.as_bytes()).unwrap();
                let upto = if n == 0 { cut.unwrap_or(body.len()).min(body.len()) } else { body.len() };
                let _ = c.write_all(&body[..upto]);
                s2.fetch_add(upto as u64, Ordering::SeqCst);
                let _ = c.shutdown(std::net::Shutdown::Both);
            }
        });
        Server { url, sent, requests }
    }

    fn payload() -> Vec<u8> {
        (0..300_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect()
    }

    fn request(s: &Server, dir: &Path, data: &[u8]) -> Request {
        let mut r = Request::new(&s.url, dir.join("blob"), Expected::Sha256(sha256_hex(data)));
        r.size = Some(data.len() as u64);
        r.backoff = Duration::from_millis(10);
        r
    }

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("mlxrs-dl-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_cut_connection_resumes_without_refetching() {
        let data = payload();
        let s = serve(data.clone(), Some(100_000), 0);
        let dir = tmpdir("cut");
        let out = fetch(&request(&s, &dir, &data), &mut |_, _| true).unwrap();
        assert_eq!(std::fs::read(dir.join("blob")).unwrap(), data);
        assert_eq!(s.sent.load(Ordering::SeqCst), data.len() as u64);
        assert_eq!(out.transferred, data.len() as u64);
        assert!(!incomplete_path(&dir.join("blob")).exists());
        assert_eq!(s.requests.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_partial_file_from_an_earlier_run_is_resumed() {
        let data = payload();
        let s = serve(data.clone(), None, 0);
        let dir = tmpdir("resume");
        std::fs::write(incomplete_path(&dir.join("blob")), &data[..123_456]).unwrap();
        let out = fetch(&request(&s, &dir, &data), &mut |_, _| true).unwrap();
        assert_eq!(out.resumed_from, 123_456);
        assert_eq!(s.sent.load(Ordering::SeqCst), (data.len() - 123_456) as u64);
        assert_eq!(std::fs::read(dir.join("blob")).unwrap(), data);
    }

    #[test]
    fn a_flipped_byte_is_refetched_once_then_an_error() {
        let data = payload();
        let s = serve(data.clone(), None, 1);
        let dir = tmpdir("flip1");
        let out = fetch(&request(&s, &dir, &data), &mut |_, _| true).unwrap();
        assert!(out.refetched);
        assert_eq!(std::fs::read(dir.join("blob")).unwrap(), data);

        let s = serve(data.clone(), None, 2);
        let dir = tmpdir("flip2");
        let e = fetch(&request(&s, &dir, &data), &mut |_, _| true).unwrap_err();
        assert!(matches!(e, DownloadError::Verify { .. }), "{e}");
        assert!(e.to_string().starts_with("blob failed verification twice"), "{e}");
        assert!(!dir.join("blob").exists() && !incomplete_path(&dir.join("blob")).exists());
    }

    #[test]
    fn no_server_is_a_network_error_after_the_retries() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/x", l.local_addr().unwrap());
        drop(l);
        let dir = tmpdir("noserver");
        let mut r = Request::new(url, dir.join("x"), Expected::Sha256("0".repeat(64)));
        r.retries = 1;
        r.backoff = Duration::from_millis(1);
        let e = fetch(&r, &mut |_, _| true).unwrap_err();
        assert!(matches!(e, DownloadError::Network { .. }), "{e}");
        assert!(e.to_string().starts_with("x: download from http://127.0.0.1:"), "{e}");
        assert!(!incomplete_path(&dir.join("x")).exists(), "an empty partial file is not left behind");
    }
}
