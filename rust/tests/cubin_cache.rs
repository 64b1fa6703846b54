//! The CUDA cubin disk cache trusts only a folder and files that no other user could have
//! written (`nvrtc::DiskCache` states the rule). Every refusal below ends in the cubin of a
//! fresh in-memory compile of the real source; a cubin planted under the predictable name is
//! never returned. Toy sources keep the compiles short; the cache does not care what it keeps.
//!
//! NVRTC is needed (no GPU): CI sets `MLX_NATIVE_REQUIRE_NVRTC=1`, and there every test runs.
#![cfg(unix)]

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use mlx_native::backend::cuda::nvrtc::{self, DiskCache, Fetched};
use sha2::{Digest, Sha256};

const FILE: &str = "toy.cu";
const ARCH: &str = "sm_80";
/// The kernel the library asks for.
const REAL: &str = r#"extern "C" __global__ void toy_fill(float* out) { out[threadIdx.x] = 1.0f; }"#;
/// Another user's kernel: the same entry point, a wrong result (zeros).
const PLANTED: &str = r#"extern "C" __global__ void toy_fill(float* out) { out[threadIdx.x] = 0.0f; }"#;
/// A user id that is not ours (`nobody`), for the cases that need root to chown.
const OTHER_UID: u32 = 65534;

fn nvrtc_required() -> bool {
    std::env::var("MLX_NATIVE_REQUIRE_NVRTC").is_ok_and(|v| v == "1")
}

/// Whether NVRTC is here; where it is required its absence fails the test.
fn have_nvrtc() -> bool {
    match nvrtc::nvrtc() {
        Ok(_) => true,
        Err(e) => {
            assert!(!nvrtc_required(), "NVRTC is required here: {e}");
            eprintln!("NVRTC not found, cubin cache test not run: {e}");
            false
        }
    }
}

fn compile(source: &str) -> Vec<u8> {
    nvrtc::nvrtc().unwrap().compile(FILE, source, &nvrtc::options(ARCH)).unwrap().0
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

fn chmod(p: &Path, mode: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().mode() & 0o7777
}

/// A private folder (0700) under the temporary folder, removed at the end.
struct Scratch(PathBuf);

impl Scratch {
    fn new(test: &str) -> Scratch {
        let p = std::env::temp_dir().join(format!("mlxn-cubin-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir(&p).unwrap();
        chmod(&p, 0o700);
        Scratch(p)
    }

    /// A cache folder inside, made with `mode` (None: left for the cache to make).
    fn cache(&self, name: &str, mode: Option<u32>) -> PathBuf {
        let d = self.0.join(name);
        if let Some(m) = mode {
            std::fs::create_dir(&d).unwrap();
            chmod(&d, m);
        }
        d
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn am_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn name() -> String {
    nvrtc::cache_file_name(FILE, REAL, ARCH).unwrap()
}

fn hash_name() -> String {
    format!("{}.sha256", name())
}

/// Put `bytes` under the cubin's predictable name in `dir`, with a matching hash file.
fn plant(dir: &Path, bytes: &[u8], file_mode: u32) {
    for (n, b) in [(name(), bytes.to_vec()), (hash_name(), format!("{}\n", sha256_hex(bytes)).into_bytes())] {
        std::fs::write(dir.join(&n), b).unwrap();
        chmod(&dir.join(&n), file_mode);
    }
}

fn fetch(dir: &Path) -> Fetched {
    nvrtc::cubin_with_cache(Some(dir), FILE, REAL, ARCH).unwrap()
}

/// The result is a fresh compile of the real source (and not `planted`, if given), and the
/// refusal names `reason`.
fn assert_fresh(f: &Fetched, reason: &str, planted: Option<&[u8]>) {
    let real = compile(REAL);
    assert!(!f.from_disk, "read from disk despite: {reason}");
    assert_eq!(nvrtc::entry_points(&f.bytes), vec!["toy_fill".to_string()]);
    assert!(f.bytes == real, "not the cubin of a fresh compile of the real source");
    if let Some(p) = planted {
        assert!(f.bytes != p, "the planted cubin was returned");
    }
    let why = f.refused.as_deref().unwrap_or_else(|| panic!("no refusal reported; expected: {reason}"));
    assert!(why.contains(reason), "refusal {why:?} does not say {reason:?}");
}

fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

/// Write the real cubin into `cache` through the cache itself, and check it reads back.
fn fill(cache: &Path) {
    assert!(!fetch(cache).from_disk);
    assert!(fetch(cache).from_disk);
}

#[test]
fn compiles_are_deterministic_and_the_planted_source_differs_only_in_behaviour() {
    if !have_nvrtc() {
        return;
    }
    let (real, planted) = (compile(REAL), compile(PLANTED));
    assert_eq!(real, compile(REAL), "the toy compile is not deterministic: the tests below compare bytes");
    assert_ne!(real, planted);
    assert_eq!(nvrtc::entry_points(&real), nvrtc::entry_points(&planted));
}

#[test]
fn a_cubin_we_wrote_is_used_again_by_a_fresh_cache() {
    if !have_nvrtc() {
        return;
    }
    let s = Scratch::new("good");
    let cache = s.cache("made/by/us", None);
    let first = fetch(&cache);
    assert!(!first.from_disk && first.refused.is_none(), "{first:?}");
    assert_eq!(first.bytes, compile(REAL));
    for d in [s.0.join("made"), s.0.join("made/by"), cache.clone()] {
        assert_eq!(mode(&d), 0o700, "{}", d.display());
    }
    assert_eq!(listing(&cache), vec![name(), hash_name()], "no temporary file is left");
    assert_eq!(mode(&cache.join(name())), 0o600);
    assert_eq!(mode(&cache.join(hash_name())), 0o600);
    assert_eq!(std::fs::read_to_string(cache.join(hash_name())).unwrap().trim(), sha256_hex(&first.bytes));

    // A new call opens a new cache object: it reads the file instead of compiling.
    let second = fetch(&cache);
    assert!(second.from_disk && second.refused.is_none(), "{second:?}");
    assert_eq!(second.bytes, first.bytes);

    // What `forget` does: both files go, and the next call compiles.
    DiskCache::open(&cache).unwrap().remove(&name());
    assert!(listing(&cache).is_empty());
    assert!(!fetch(&cache).from_disk);
}

#[test]
fn a_group_writable_folder_is_not_used() {
    if !have_nvrtc() {
        return;
    }
    let s = Scratch::new("group-folder");
    let cache = s.cache("cache", Some(0o770));
    let planted = compile(PLANTED);
    plant(&cache, &planted, 0o600);
    let before = listing(&cache);
    assert_fresh(&fetch(&cache), "is writable by group (mode 0770)", Some(&planted[..]));
    assert_eq!(listing(&cache), before, "nothing is written into a folder that is not used");
    assert!(DiskCache::open(&cache).is_err());
}

#[test]
fn a_world_writable_folder_is_not_used() {
    if !have_nvrtc() {
        return;
    }
    let s = Scratch::new("world-folder");
    let planted = compile(PLANTED);
    for (m, reason) in
        [(0o707, "is writable by others (mode 0707)"), (0o1777, "writable by group and others (mode 1777)")]
    {
        let cache = s.cache(&format!("cache{m:o}"), Some(m));
        plant(&cache, &planted, 0o644);
        let before = listing(&cache);
        assert_fresh(&fetch(&cache), reason, Some(&planted[..]));
        assert_eq!(listing(&cache), before);
    }
}

#[test]
fn a_folder_above_the_cache_must_be_ours_or_roots_and_not_writable_by_others_unless_sticky() {
    if !have_nvrtc() {
        return;
    }
    let s = Scratch::new("ancestors");
    let planted = compile(PLANTED);

    // Writable by others, not sticky: anyone could rename our folder and put theirs there.
    let open = s.cache("open", Some(0o777));
    let cache = open.join("cache");
    std::fs::create_dir(&cache).unwrap();
    chmod(&cache, 0o700);
    plant(&cache, &planted, 0o600);
    assert_fresh(
        &fetch(&cache),
        "open above it is writable by group and others and not sticky (mode 0777)",
        Some(&planted[..]),
    );

    // The same folder, sticky (as /tmp is): our folder inside it is ours to keep.
    chmod(&open, 0o1777);
    std::fs::remove_dir_all(&cache).unwrap();
    fill(&cache);

    // Group-writable, not sticky.
    chmod(&open, 0o770);
    assert_fresh(&fetch(&cache), "open above it is writable by group and not sticky (mode 0770)", None);
    chmod(&open, 0o755);
    assert!(fetch(&cache).from_disk);

    // An ancestor owned by another user (needs root to make; CI runs as root).
    if am_root() {
        std::os::unix::fs::chown(&open, Some(OTHER_UID), None).unwrap();
        assert_fresh(
            &fetch(&cache),
            &format!("open above it is owned by uid {OTHER_UID}, neither uid 0 nor root"),
            None,
        );
    } else {
        eprintln!("not root: the foreign-owned ancestor case needs root to chown");
    }
}

#[test]
fn a_folder_owned_by_another_user_is_not_used() {
    if !have_nvrtc() {
        return;
    }
    if !am_root() {
        // The rule for files, the same check on ownership, runs for everyone in
        // a_cubin_owned_by_another_user_is_not_used.
        eprintln!("not root: a folder of another user cannot be made here");
        return;
    }
    let s = Scratch::new("foreign-folder");
    let cache = s.cache("cache", Some(0o700));
    let planted = compile(PLANTED);
    plant(&cache, &planted, 0o600);
    std::os::unix::fs::chown(&cache, Some(OTHER_UID), None).unwrap();
    assert_fresh(&fetch(&cache), &format!("is owned by uid {OTHER_UID}, not by uid 0"), Some(&planted[..]));
}

#[test]
fn a_cubin_owned_by_another_user_is_not_used() {
    if !have_nvrtc() {
        return;
    }
    let s = Scratch::new("foreign-file");
    let cache = s.cache("cache", None);
    fill(&cache);
    let us = std::fs::metadata(cache.join(name())).unwrap().uid();
    // For everyone: the check made on each opened file refuses a file of any uid but ours.
    let m = std::fs::metadata(cache.join(name())).unwrap();
    assert!(nvrtc::file_refusal(&m, us).is_none());
    assert!(nvrtc::file_refusal(&m, us + 1).unwrap().contains(&format!("is owned by uid {us}, not by uid {}", us + 1)));
    if us != 0 {
        eprintln!("not root: the cubin of another user cannot be made here, checked through file_refusal only");
        return;
    }
    // Root (CI): the real thing, a planted cubin of another user with a matching hash file.
    let planted = compile(PLANTED);
    plant(&cache, &planted, 0o600);
    std::os::unix::fs::chown(cache.join(name()), Some(OTHER_UID), None).unwrap();
    assert_fresh(&fetch(&cache), &format!("it is owned by uid {OTHER_UID}, not by uid 0"), Some(&planted[..]));
    // It was replaced by our own, which is used from then on.
    assert_eq!(std::fs::metadata(cache.join(name())).unwrap().uid(), 0);
    assert!(fetch(&cache).from_disk);

    // The hash file of another user.
    std::os::unix::fs::chown(cache.join(hash_name()), Some(OTHER_UID), None).unwrap();
    assert_fresh(&fetch(&cache), &format!("its hash file {} is owned by uid {OTHER_UID}", hash_name()), None);
}

#[test]
fn a_tampered_cubin_is_not_used() {
    if !have_nvrtc() {
        return;
    }
    let s = Scratch::new("tampered");
    let cache = s.cache("cache", None);
    fill(&cache);
    let path = cache.join(name());
    let mut b = std::fs::read(&path).unwrap();
    let last = b.len() - 1;
    b[last] ^= 0x55; // still an ELF file, still ours and 0600; the hash file left as it was
    std::fs::write(&path, &b).unwrap();
    assert_fresh(&fetch(&cache), &format!("its content does not match the SHA-256 in {}", hash_name()), Some(&b[..]));
    assert!(fetch(&cache).from_disk, "the damaged file was replaced");

    // Not an ELF file at all, with a hash file that matches it.
    plant(&cache, b"not a cubin", 0o600);
    assert_fresh(&fetch(&cache), "it is not an ELF file", None);
    assert!(fetch(&cache).from_disk);
}

#[test]
fn a_cubin_without_its_hash_file_is_not_used() {
    if !have_nvrtc() {
        return;
    }
    let s = Scratch::new("no-hash");
    let cache = s.cache("cache", None);
    fill(&cache);
    std::fs::remove_file(cache.join(hash_name())).unwrap();
    assert_fresh(&fetch(&cache), &format!("it has no hash file ({})", hash_name()), None);
    assert!(fetch(&cache).from_disk);
}

#[test]
fn a_symbolic_link_in_place_of_a_cached_file_is_not_followed() {
    if !have_nvrtc() {
        return;
    }
    let s = Scratch::new("symlink");
    let cache = s.cache("cache", None);
    fill(&cache);

    // The cubin swapped for a link to a planted one (ours, 0600, its hash in place).
    let planted = compile(PLANTED);
    let elsewhere = s.cache("elsewhere", Some(0o700));
    plant(&elsewhere, &planted, 0o600);
    std::fs::remove_file(cache.join(name())).unwrap();
    std::os::unix::fs::symlink(elsewhere.join(name()), cache.join(name())).unwrap();
    std::fs::copy(elsewhere.join(hash_name()), cache.join(hash_name())).unwrap();
    assert_fresh(&fetch(&cache), "it is a symbolic link", Some(&planted[..]));
    assert!(!std::fs::symlink_metadata(cache.join(name())).unwrap().file_type().is_symlink(), "the link was replaced");
    assert_eq!(std::fs::read(elsewhere.join(name())).unwrap(), planted, "the link's target is left alone");
    assert!(fetch(&cache).from_disk);

    // The hash file swapped for a link to a matching hash.
    let real = std::fs::read(cache.join(name())).unwrap();
    std::fs::write(elsewhere.join("hash"), sha256_hex(&real)).unwrap();
    std::fs::remove_file(cache.join(hash_name())).unwrap();
    std::os::unix::fs::symlink(elsewhere.join("hash"), cache.join(hash_name())).unwrap();
    assert_fresh(&fetch(&cache), &format!("its hash file {} is a symbolic link", hash_name()), None);
    assert!(fetch(&cache).from_disk);
}

#[test]
fn a_group_writable_cubin_is_not_used() {
    if !have_nvrtc() {
        return;
    }
    let s = Scratch::new("group-file");
    let cache = s.cache("cache", None);
    fill(&cache);
    chmod(&cache.join(name()), 0o620);
    assert_fresh(&fetch(&cache), "it is writable by group (mode 0620)", None);
    assert_eq!(mode(&cache.join(name())), 0o600, "replaced by a 0600 file");
    assert!(fetch(&cache).from_disk);

    chmod(&cache.join(name()), 0o602);
    assert_fresh(&fetch(&cache), "it is writable by others (mode 0602)", None);
    chmod(&cache.join(hash_name()), 0o660);
    assert_fresh(&fetch(&cache), &format!("its hash file {} is writable by group (mode 0660)", hash_name()), None);
    assert!(fetch(&cache).from_disk);
}

/// The attack: another user puts a cubin of their own kernel, with the entry point the
/// library asks for and a hash file that matches it, under the exact predictable name.
#[test]
fn a_planted_cubin_is_never_loaded() {
    if !have_nvrtc() {
        return;
    }
    let planted = compile(PLANTED);
    assert_eq!(nvrtc::entry_points(&planted), vec!["toy_fill".to_string()]);
    let s = Scratch::new("planted");

    // A shared folder: the default folder name, made by whoever came first, open to all.
    let shared = s.cache("shared", Some(0o777));
    plant(&shared, &planted, 0o644);
    assert_fresh(&fetch(&shared), "writable by group and others", Some(&planted[..]));
    assert_eq!(std::fs::read(shared.join(name())).unwrap(), planted, "left as it was, unused");

    // A sticky shared folder (a /tmp of its own): still not ours alone.
    chmod(&shared, 0o1777);
    assert_fresh(&fetch(&shared), "writable by group and others", Some(&planted[..]));

    // Our own private folder, the planted files owned by another user (root can make it).
    if am_root() {
        let ours = s.cache("ours", Some(0o700));
        plant(&ours, &planted, 0o600);
        for n in [name(), hash_name()] {
            std::os::unix::fs::chown(ours.join(n), Some(OTHER_UID), None).unwrap();
        }
        assert_fresh(&fetch(&ours), &format!("is owned by uid {OTHER_UID}"), Some(&planted[..]));
        assert!(fetch(&ours).bytes != planted);
    }

    // Our own private folder, the planted files left writable by a group (a group's copy).
    let ours = s.cache("ours-group", Some(0o700));
    plant(&ours, &planted, 0o664);
    assert_fresh(&fetch(&ours), "writable by group (mode 0664)", Some(&planted[..]));
    assert!(fetch(&ours).bytes != planted);
}

#[test]
fn a_symbolic_link_to_the_cache_folder_is_resolved_once() {
    if !have_nvrtc() {
        return;
    }
    let s = Scratch::new("folder-link");
    let real = s.cache("real", Some(0o700));
    let link = s.0.join("link");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let c = DiskCache::open(&link).unwrap();
    assert_eq!(c.dir(), std::fs::canonicalize(&real).unwrap());
    fill(&link);
    assert_eq!(listing(&real), vec![name(), hash_name()]);
    // A link to a folder that fails is no way around the rule.
    chmod(&real, 0o777);
    assert_fresh(&fetch(&link), "resolved", None);
}
