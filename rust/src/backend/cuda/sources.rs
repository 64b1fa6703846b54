//! The text NVRTC compiles for a CUDA source file: the file and its headers (the kernel is in
//! parts, `shaders/flash_attn_prefill/`), each possibly replaced by a development folder's
//! copy, joined into one translation unit on the host.
//!
//! Joining (rather than handing NVRTC the headers) keeps one text per program, which the
//! cubin cache keys on and the compiler's messages point into: each part starts with a
//! `#line` marker naming it, so an error names the part and its line.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, OnceLock};

use crate::error::{MlxError, Result};
use crate::interface::SourceFile;

/// The text of the file `name` whose built-in text is `text`: the copy of the same name in
/// the folder `MLX_NATIVE_CUDA_SOURCE_DIR` names (`settings`; a development knob: mutation
/// testing, trying a kernel change on a machine without Rust) where it has one, else
/// `text`. The variable is read
/// once, and each file once (its text then stays for the process), so a process compiles
/// one version of each file. A variable that names no folder is an error, not a silent
/// fall-back to the built-in source.
pub fn effective_text(name: &'static str, text: &'static str) -> Result<&'static str> {
    static FILES: OnceLock<Mutex<HashMap<&'static str, Option<&'static str>>>> = OnceLock::new();
    let Some(dir) = &crate::settings::get().cuda_source_dir else {
        return Ok(text);
    };
    let mut files = FILES.get_or_init(|| Mutex::new(HashMap::new())).lock().unwrap_or_else(|e| e.into_inner());
    let replaced = match files.get(name) {
        Some(t) => *t,
        None => {
            let t = read_override(dir, name)?.map(|t| &*Box::leak(t.into_boxed_str()));
            if t.is_some() {
                eprintln!(
                    "mlx_native: warning: compiling {} in place of the built-in {name} ({})",
                    dir.join(name).display(),
                    crate::settings::CUDA_SOURCE_DIR
                );
            }
            files.insert(name, t);
            t
        }
    };
    Ok(replaced.unwrap_or(text))
}

/// The text of `dir/name`, `None` where the folder has no such file; an error where `dir`
/// is not a folder or the file cannot be read as UTF-8 text.
pub(crate) fn read_override(dir: &std::path::Path, name: &str) -> Result<Option<String>> {
    if !dir.is_dir() {
        return Err(MlxError::InvalidArgument(format!(
            "{}={} is not a folder",
            crate::settings::CUDA_SOURCE_DIR,
            dir.display()
        )));
    }
    let path = dir.join(name);
    match std::fs::read_to_string(&path) {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(MlxError::InvalidArgument(format!(
            "{}: cannot read {}: {e}",
            crate::settings::CUDA_SOURCE_DIR,
            path.display()
        ))),
    }
}

/// The one translation unit of `src`: its text with each `#include "<header>"` of one of its
/// headers replaced by that header's text (itself joined; each header once, as `#pragma
/// once` asks), every file in its effective form ([`effective_text`]).
pub fn compiled_source(src: SourceFile) -> Result<String> {
    let mut texts = HashMap::new();
    for &(name, text) in src.headers {
        texts.insert(name, effective_text(name, text)?);
    }
    let main = effective_text(src.name, src.text)?;
    let mut out = String::with_capacity(main.len() + texts.values().map(|t| t.len() + 64).sum::<usize>());
    let mut done = HashSet::new();
    join(src.name, main, &texts, &mut done, &mut out)?;
    Ok(out)
}

fn join<'a>(
    name: &str,
    text: &'a str,
    headers: &HashMap<&'a str, &'a str>,
    done: &mut HashSet<&'a str>,
    out: &mut String,
) -> Result<()> {
    out.push_str(&format!("#line 1 \"{name}\"\n"));
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim();
        if trimmed == "#pragma once" {
            out.push('\n');
            continue;
        }
        let included = trimmed
            .strip_prefix("#include")
            .map(str::trim)
            .and_then(|r| r.strip_prefix('"'))
            .and_then(|r| r.split('"').next());
        match included.and_then(|h| headers.get_key_value(h)) {
            Some((&h, &t)) => {
                if done.insert(h) {
                    join(h, t, headers, done, out)?;
                    out.push_str(&format!("#line {} \"{name}\"\n", i + 2));
                } else {
                    out.push('\n');
                }
            }
            None if included.is_some() => {
                return Err(MlxError::ShaderCompilationError {
                    name: name.to_string(),
                    message: format!("line {}: {trimmed}: no such part among the source's headers", i + 1),
                })
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_folder_replaces_only_the_files_it_has() {
        let dir = std::env::temp_dir().join(format!("mlxn-source-dir-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("a.cu"), "// replaced").unwrap();
        assert_eq!(read_override(&dir, "a.cu").unwrap().as_deref(), Some("// replaced"));
        assert_eq!(read_override(&dir, "b.cu").unwrap(), None, "a file the folder lacks stays built in");
        let missing = dir.join("no-such-folder");
        let err = read_override(&missing, "a.cu").unwrap_err();
        assert!(err.to_string().contains("is not a folder"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn headers_are_joined_once_each_with_line_markers() {
        let src = SourceFile {
            name: "main.cu",
            text: "#include \"p/a.cuh\"\n#include \"p/b.cuh\"\nint main_line;\n",
            headers: &[
                ("p/a.cuh", "#pragma once\nint a;\n"),
                ("p/b.cuh", "#pragma once\n#include \"p/a.cuh\"\nint b;\n"),
            ],
        };
        let j = compiled_source(src).unwrap();
        assert_eq!(j.matches("int a;").count(), 1, "{j}");
        assert!(j.contains("#line 1 \"p/a.cuh\""), "{j}");
        assert!(j.contains("#line 3 \"main.cu\"\nint main_line;"), "{j}");
        assert!(!j.contains("#pragma once"), "{j}");
        let a = j.find("int a;").unwrap();
        assert!(a < j.find("int b;").unwrap() && j.find("int b;").unwrap() < j.find("int main_line;").unwrap());
        let bad = SourceFile { name: "m.cu", text: "#include \"p/missing.cuh\"\n", headers: &[] };
        assert!(matches!(compiled_source(bad), Err(MlxError::ShaderCompilationError { .. })));
    }
}
