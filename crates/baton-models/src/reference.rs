//! What a user names a model file by: `owner/name:file` (optionally `owner/name@revision:file`),
//! or the file's page or download address on the hub as a browser shows it.

use std::fmt;

/// One file in one hub repository at one revision.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct ModelRef {
    /// `owner/name`.
    pub repo: String,
    /// A branch, tag or commit; `main` unless the user named one.
    pub revision: String,
    /// The file's path inside the repository (`/`-separated; may name a folder).
    pub file: String,
}

/// Why a model reference could not be read; says what the accepted forms are.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "\"{input}\" is not a model file reference: {why}. Write REPO:FILE, for example \
     Qwen/Qwen2.5-1.5B-Instruct-GGUF:qwen2.5-1.5b-instruct-q4_k_m.gguf (REPO@REVISION:FILE for \
     another branch or commit), or paste the file's address from the hub"
)]
pub struct RefError {
    pub input: String,
    pub why: String,
}

impl ModelRef {
    pub fn new(repo: &str, revision: &str, file: &str) -> ModelRef {
        ModelRef { repo: repo.to_owned(), revision: revision.to_owned(), file: file.to_owned() }
    }

    /// Reads `owner/name[@revision]:file` or `https://<host>/owner/name/(blob|resolve)/rev/file`.
    pub fn parse(input: &str) -> Result<ModelRef, RefError> {
        let s = input.trim();
        let bad = |why: &str| RefError { input: input.to_owned(), why: why.to_owned() };
        if let Some(rest) = s.strip_prefix("https://").or_else(|| s.strip_prefix("http://")) {
            // host/owner/name/blob|resolve/revision/path…, with any query (`?download=true`) dropped.
            let rest = rest.split(['?', '#']).next().unwrap_or_default();
            let parts: Vec<&str> = rest.split('/').collect();
            if parts.len() < 6 || !matches!(parts[3], "blob" | "resolve") {
                return Err(bad("an address must look like https://huggingface.co/OWNER/NAME/blob/REVISION/FILE"));
            }
            let r = ModelRef::new(&format!("{}/{}", parts[1], parts[2]), parts[4], &parts[5..].join("/"));
            return r.checked().map_err(|why| bad(&why));
        }
        let Some((repo, file)) = s.split_once(':') else {
            return Err(bad("there is no ':' between the repository and the file"));
        };
        let (repo, revision) = match repo.split_once('@') {
            Some((repo, rev)) => (repo, rev),
            None => (repo, "main"),
        };
        ModelRef::new(repo, revision, file).checked().map_err(|why| bad(&why))
    }

    fn checked(self) -> Result<ModelRef, String> {
        let name_ok = |s: &str| {
            !s.is_empty()
                && s != "."
                && s != ".."
                && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        };
        let Some((owner, name)) = self.repo.split_once('/') else {
            return Err(format!("the repository \"{}\" is not OWNER/NAME", self.repo));
        };
        if !name_ok(owner) || !name_ok(name) {
            return Err(format!("the repository \"{}\" is not OWNER/NAME (letters, digits, - _ .)", self.repo));
        }
        if self.revision.is_empty() || self.revision.contains("..") || self.revision.starts_with('/') {
            return Err(format!("the revision \"{}\" is not a branch, tag or commit", self.revision));
        }
        // The file becomes a path under the cache: nothing may climb out of it.
        let segments: Vec<&str> = self.file.split('/').collect();
        if self.file.is_empty() || segments.iter().any(|s| s.is_empty() || *s == "." || *s == ".." || s.contains('\\'))
        {
            return Err(format!("the file \"{}\" is not a path inside the repository", self.file));
        }
        Ok(self)
    }

    /// The file's name without its folders.
    pub fn file_name(&self) -> &str {
        self.file.rsplit('/').next().unwrap_or(&self.file)
    }
}

impl fmt::Display for ModelRef {
    /// The form [`ModelRef::parse`] reads back; `@main` is left out.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.revision == "main" {
            write!(f, "{}:{}", self.repo, self.file)
        } else {
            write!(f, "{}@{}:{}", self.repo, self.revision, self.file)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_read_in_every_documented_form() {
        let r = ModelRef::parse("Qwen/Qwen2.5-1.5B-Instruct-GGUF:qwen2.5-1.5b-instruct-q4_k_m.gguf").unwrap();
        assert_eq!(r, ModelRef::new("Qwen/Qwen2.5-1.5B-Instruct-GGUF", "main", "qwen2.5-1.5b-instruct-q4_k_m.gguf"));
        assert_eq!(r.to_string(), "Qwen/Qwen2.5-1.5B-Instruct-GGUF:qwen2.5-1.5b-instruct-q4_k_m.gguf");

        let r = ModelRef::parse("a/b@v1.0:sub/dir/m.gguf").unwrap();
        assert_eq!((r.revision.as_str(), r.file.as_str(), r.file_name()), ("v1.0", "sub/dir/m.gguf", "m.gguf"));
        assert_eq!(ModelRef::parse(&r.to_string()).unwrap(), r);

        let page =
            "https://huggingface.co/bartowski/Llama-3.2-3B-Instruct-GGUF/blob/main/Llama-3.2-3B-Instruct-Q4_K_M.gguf";
        let r = ModelRef::parse(page).unwrap();
        assert_eq!(
            r,
            ModelRef::new("bartowski/Llama-3.2-3B-Instruct-GGUF", "main", "Llama-3.2-3B-Instruct-Q4_K_M.gguf")
        );
        let download = "https://hf-mirror.com/o/n/resolve/abc123/m.gguf?download=true";
        assert_eq!(ModelRef::parse(download).unwrap(), ModelRef::new("o/n", "abc123", "m.gguf"));
    }

    #[test]
    fn a_reference_that_could_leave_the_cache_or_is_incomplete_is_refused_with_the_forms() {
        for bad in [
            "Qwen/Qwen2.5",
            "Qwen:file.gguf",
            "a/b:../../etc/passwd",
            "a/b:/abs.gguf",
            "a/..:m.gguf",
            "a/b@../x:m.gguf",
            "a/b:",
            "https://huggingface.co/a/b",
            "a/b:dir//m.gguf",
        ] {
            let e = ModelRef::parse(bad).expect_err(bad).to_string();
            assert!(e.contains("REPO:FILE") && e.contains(bad), "{e}");
        }
    }
}
