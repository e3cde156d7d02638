//! The invariants ARCHITECTURE.md states, checked against the code: the layer table against
//! `cargo metadata`, and the source tree for import circles, file sizes and who may touch what.
//! A change that breaks one of them changes the map, or the code, on purpose.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace root").to_owned()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                todo.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// The layer table: crate → (layer, the workspace crates it depends on).
fn layer_table() -> BTreeMap<String, (u32, BTreeSet<String>)> {
    let text = read(&root().join("ARCHITECTURE.md"));
    let section = text.split("\n## Layers\n").nth(1).expect("ARCHITECTURE.md has a `## Layers` section");
    let mut table = BTreeMap::new();
    for line in section.lines().take_while(|l| !l.starts_with("## ")) {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        // | `crate` | layer | `dep`, `dep` | what it may not know |
        if cells.len() < 4 || !cells[1].starts_with('`') {
            continue;
        }
        let name = cells[1].trim_matches('`').to_owned();
        let layer = cells[2].parse().unwrap_or_else(|_| panic!("{name}: layer {:?} is not a number", cells[2]));
        let deps = cells[3]
            .split(',')
            .map(|d| d.trim().trim_matches('`').to_owned())
            .filter(|d| !d.is_empty() && d != "—")
            .collect();
        table.insert(name, (layer, deps));
    }
    assert!(!table.is_empty(), "the layer table has no rows");
    table
}

/// Each workspace crate's dependencies on other workspace crates, from `cargo metadata`, as
/// (kind, crate) pairs: kind `normal`, `build` or `dev`.
fn workspace_dependencies() -> BTreeMap<String, BTreeSet<(String, String)>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let out = std::process::Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline"])
        .current_dir(root())
        .output()
        .expect("cargo metadata runs");
    assert!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    let metadata: serde_json::Value = serde_json::from_slice(&out.stdout).expect("cargo metadata's JSON");
    let packages = metadata["packages"].as_array().expect("packages");
    let members: BTreeSet<String> =
        packages.iter().map(|p| p["name"].as_str().expect("a package name").to_owned()).collect();
    packages
        .iter()
        .map(|p| {
            let deps = p["dependencies"]
                .as_array()
                .expect("dependencies")
                .iter()
                .filter_map(|d| {
                    Some((d["kind"].as_str().unwrap_or("normal").to_owned(), d["name"].as_str()?.to_owned()))
                })
                .filter(|(_, d)| members.contains(d))
                .collect();
            (p["name"].as_str().expect("a package name").to_owned(), deps)
        })
        .collect()
}

#[test]
fn the_layer_table_is_the_crates_dependencies_and_each_depends_only_on_lower_layers() {
    let table = layer_table();
    let actual = workspace_dependencies();
    let listed: BTreeSet<&String> = table.keys().collect();
    let crates: BTreeSet<&String> = actual.keys().collect();
    assert_eq!(listed, crates, "ARCHITECTURE.md's layer table must list every workspace crate, and only those");
    let mut wrong = Vec::new();
    for (name, deps) in &actual {
        let (layer, allowed) = &table[name];
        let normal: BTreeSet<String> = deps.iter().filter(|(k, _)| k == "normal").map(|(_, d)| d.clone()).collect();
        if normal != *allowed {
            wrong.push(format!(
                "{name}: its Cargo.toml's workspace dependencies are {normal:?}, the table says {allowed:?}"
            ));
        }
        // Tests and build scripts too: a test that reaches up a layer ties the layers together
        // as surely as the code does, and the table lists only what the code needs.
        for (kind, dep) in deps {
            let (below, _) = table[dep];
            if below >= *layer {
                wrong.push(format!(
                    "{name} (layer {layer}) has a {kind} dependency on {dep} (layer {below}): not a lower layer"
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "the crates' dependencies against ARCHITECTURE.md's layer table:\n{}", wrong.join("\n"));
}

/// A word or mark of Rust source, with its line.
#[derive(Debug, Clone, PartialEq)]
struct Token {
    text: String,
    line: usize,
}

/// Rust source as the tokens paths are made of: identifiers and keywords, `::`, and single
/// punctuation marks. Comments, string and character literals and lifetimes are dropped, so that
/// a doc link, a message or a `'{'` is not read as code.
fn tokens(text: &str) -> Vec<Token> {
    let chars: Vec<char> = text.chars().collect();
    let at = |i: usize| chars.get(i).copied().unwrap_or('\0');
    let word_char = |c: char| c.is_alphanumeric() || c == '_';
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    // The index just past a string whose opening quote is at `start`, raw with `hashes` `#`s
    // when `raw` (no escapes).
    let string_end = |start: usize, raw: bool, hashes: usize| {
        let mut j = start + 1;
        while j < chars.len() {
            if !raw && chars[j] == '\\' {
                j += 2;
            } else if chars[j] == '"' && (0..hashes).all(|h| at(j + 1 + h) == '#') {
                return j + 1 + hashes;
            } else {
                j += 1;
            }
        }
        chars.len()
    };
    while i < chars.len() {
        let (c, next) = (chars[i], at(i + 1));
        let end = if c == '/' && next == '/' {
            (i..chars.len()).find(|&j| chars[j] == '\n').unwrap_or(chars.len())
        } else if c == '/' && next == '*' {
            // Block comments nest.
            let (mut j, mut depth) = (i, 0);
            while j < chars.len() {
                if chars[j] == '/' && at(j + 1) == '*' {
                    depth += 1;
                    j += 2;
                } else if chars[j] == '*' && at(j + 1) == '/' {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            j
        } else if c == '"' {
            string_end(i, false, 0)
        } else if c == '\'' {
            // A character literal (`'x'`, `'\''`, `'\u{7f}'`), or a lifetime or label, dropped alike.
            if next == '\\' {
                (i + 3..chars.len()).find(|&j| chars[j] == '\'').map_or(chars.len(), |j| j + 1)
            } else if at(i + 2) == '\'' {
                i + 3
            } else {
                (i + 1..chars.len()).find(|&j| !word_char(chars[j])).unwrap_or(chars.len())
            }
        } else if word_char(c) {
            let end = (i..chars.len()).find(|&j| !word_char(chars[j])).unwrap_or(chars.len());
            let word: String = chars[i..end].iter().collect();
            let hashes = (end..chars.len()).take_while(|&j| chars[j] == '#').count();
            if matches!(word.as_str(), "r" | "br" | "cr") && at(end + hashes) == '"' {
                string_end(end + hashes, true, hashes)
            } else if matches!(word.as_str(), "b" | "c") && at(end) == '"' {
                string_end(end, false, 0)
            } else if word == "b" && at(end) == '\'' {
                // A byte: the quote that follows reads as a character literal.
                end
            } else if word == "r" && hashes == 1 && word_char(at(end + 1)) {
                // A raw identifier (`r#type`): the word is what follows.
                end + 1
            } else {
                out.push(Token { text: word, line });
                end
            }
        } else if c == ':' && next == ':' {
            out.push(Token { text: "::".to_owned(), line });
            i + 2
        } else {
            if !c.is_whitespace() {
                out.push(Token { text: c.to_string(), line });
            }
            i + 1
        };
        let end = end.min(chars.len());
        line += chars[i..end].iter().filter(|c| **c == '\n').count();
        i = end;
    }
    out
}

fn is_word(text: &str) -> bool {
    text.starts_with(|c: char| c.is_alphabetic() || c == '_')
}

/// `path` from the crate root, for code in module `module` (`["harness", "jobs"]`); `None` when
/// it does not start at `crate`, `super` or `self`, or climbs past the root. A `self` inside a
/// path (`use a::{self, b}`) is the path before it.
fn absolute(path: &[String], module: &[String]) -> Option<Vec<String>> {
    let mut out = match path.first()?.as_str() {
        "crate" => Vec::new(),
        "self" | "super" => module.to_vec(),
        _ => return None,
    };
    let mut leading = true;
    for segment in &path[usize::from(path[0] == "crate")..] {
        match segment.as_str() {
            "self" => {}
            "super" if leading => {
                out.pop()?;
            }
            _ => {
                leading = false;
                out.push(segment.clone());
            }
        }
    }
    Some(out)
}

/// Reads the use tree starting at `tokens[*i]` (after `use`), adding each path it names, with the
/// name it binds (`None` for a glob), to `out`. `false` when it is not a use tree (`use<'a>`).
fn use_tree(tokens: &[Token], i: &mut usize, prefix: &[String], out: &mut Vec<(Vec<String>, Option<String>)>) -> bool {
    let at = |i: usize| tokens.get(i).map_or("", |t| t.text.as_str());
    let mut path = prefix.to_vec();
    if at(*i) == "::" {
        *i += 1;
    }
    loop {
        match at(*i) {
            "{" => {
                *i += 1;
                loop {
                    if at(*i) == "}" {
                        *i += 1;
                        return true;
                    }
                    if !use_tree(tokens, i, &path, out) {
                        return false;
                    }
                    match at(*i) {
                        "," => *i += 1,
                        "}" => {}
                        _ => return false,
                    }
                }
            }
            "*" => {
                *i += 1;
                out.push((path, None));
                return true;
            }
            word if is_word(word) => {
                path.push(word.to_owned());
                *i += 1;
                if at(*i) == "::" {
                    *i += 1;
                    continue;
                }
                let name = if at(*i) == "as" && is_word(at(*i + 1)) {
                    *i += 2;
                    at(*i - 1).to_owned()
                } else {
                    // `a::{self}` binds `a`.
                    path.iter().rev().find(|s| *s != "self").cloned().unwrap_or_default()
                };
                out.push((path, Some(name)));
                return true;
            }
            _ => return false,
        }
    }
}

/// A path into the crate, made absolute, and where it is named.
#[derive(Debug, Clone, PartialEq)]
struct Reference {
    /// The module whose code names it (inline `mod` blocks included).
    from: Vec<String>,
    to: Vec<String>,
    line: usize,
}

/// What one source file says about its crate's modules, outside unit tests.
#[derive(Debug, Default)]
struct Scan {
    /// Every path that starts at `crate`, `super` or `self`, in a `use` (groups nested to any
    /// depth, over many lines) or inline in code: `use super::{jobs::Job, Harness}` in
    /// `harness/run_one.rs` names `harness::jobs::Job` and `harness::Harness`.
    references: Vec<Reference>,
    /// Each name a `use` binds, with the module it is bound in and the path it stands for
    /// (a path without `crate`, `super` or `self` is taken from that module, as Rust does):
    /// `pub use executor::{Executor as E}` at the crate root binds `E` to `executor::Executor`.
    names: Vec<(Vec<String>, String, Vec<String>)>,
    /// The modules declared by `mod name;`, whose files belong to the crate.
    files: Vec<Vec<String>>,
    /// The modules declared inline, by `mod name { … }`.
    inline: Vec<Vec<String>>,
}

/// Reads `text`, the file of module `module` (`[]` for the crate root). Items under
/// `#[cfg(test)]` (unit tests may reach anywhere in their crate), and with them the files of
/// `#[cfg(test)] mod tests;`, are left out.
fn scan(text: &str, module: &[String]) -> Scan {
    let tokens = tokens(text);
    let at = |i: usize| tokens.get(i).map_or("", |t| t.text.as_str());
    let starts = |i: usize, marks: &[&str]| marks.iter().enumerate().all(|(k, m)| at(i + k) == *m);
    const CFG_TEST: [&str; 7] = ["#", "[", "cfg", "(", "test", ")", "]"];
    let mut out = Scan::default();
    if starts(0, &["#", "!"]) && starts(2, &CFG_TEST[1..]) {
        return out;
    }
    // The inline modules open around the current token, each with the brace depth inside it.
    let mut open: Vec<(String, usize)> = Vec::new();
    let mut depth = 0;
    let here = |open: &[(String, usize)]| -> Vec<String> {
        module.iter().cloned().chain(open.iter().map(|(name, _)| name.clone())).collect()
    };
    // The index just past the bracketed group that opens at `i`.
    let group_end = |i: usize| {
        let mut nesting = 0;
        for (j, t) in tokens.iter().enumerate().skip(i) {
            match t.text.as_str() {
                "{" | "(" | "[" => nesting += 1,
                "}" | ")" | "]" => {
                    nesting -= 1;
                    if nesting == 0 {
                        return j + 1;
                    }
                }
                _ => {}
            }
        }
        tokens.len()
    };
    let mut i = 0;
    while i < tokens.len() {
        let text = at(i);
        if starts(i, &CFG_TEST) {
            // Skip the item: its other attributes, then up to its `;` or past its body.
            i += CFG_TEST.len();
            while starts(i, &["#", "["]) {
                i = group_end(i + 1);
            }
            while i < tokens.len() {
                match at(i) {
                    ";" => {
                        i += 1;
                        break;
                    }
                    "{" => {
                        i = group_end(i);
                        break;
                    }
                    "(" | "[" => i = group_end(i),
                    _ => i += 1,
                }
            }
        } else if text == "mod" && is_word(at(i + 1)) && matches!(at(i + 2), "{" | ";") {
            let mut declared = here(&open);
            declared.push(at(i + 1).to_owned());
            if at(i + 2) == "{" {
                depth += 1;
                open.push((at(i + 1).to_owned(), depth));
                out.inline.push(declared);
            } else {
                out.files.push(declared);
            }
            i += 3;
        } else if text == "use" {
            let mut tree = Vec::new();
            let mut j = i + 1;
            if !use_tree(&tokens, &mut j, &[], &mut tree) {
                i += 1;
                continue;
            }
            let from = here(&open);
            for (path, name) in tree {
                let to = absolute(&path, &from);
                if let Some(name) = name {
                    let named = to.clone().unwrap_or_else(|| from.iter().chain(&path).cloned().collect());
                    out.names.push((from.clone(), name, named));
                }
                if let Some(to) = to {
                    out.references.push(Reference { from: from.clone(), to, line: tokens[i].line });
                }
            }
            i = j;
        } else if matches!(text, "crate" | "super" | "self")
            && at(i + 1) == "::"
            && !matches!(i.checked_sub(1).map_or("", at), "::" | "$")
        {
            // A path inline in code (`crate::sandbox::Limits::default()`); `$crate::` is a
            // macro's, `a::self` not a start.
            let mut path = vec![text.to_owned()];
            let mut j = i + 1;
            while at(j) == "::" && is_word(at(j + 1)) {
                path.push(at(j + 1).to_owned());
                j += 2;
            }
            let from = here(&open);
            if let Some(to) = absolute(&path, &from) {
                out.references.push(Reference { from, to, line: tokens[i].line });
            }
            i = j;
        } else {
            match text {
                "{" => depth += 1,
                "}" => {
                    depth = depth.saturating_sub(1);
                    while open.last().is_some_and(|(_, d)| *d > depth) {
                        open.pop();
                    }
                }
                _ => {}
            }
            i += 1;
        }
    }
    out
}

/// The files of the crate whose root is `root_file`, found from it through `mod name;`
/// declarations (so a binary's files and unit-test files are not the library's), each with its
/// module and what it says.
fn crate_files(root_file: &Path) -> Vec<(PathBuf, Vec<String>, Scan)> {
    let dir = root_file.parent().expect("a crate root's folder");
    let mut out = Vec::new();
    let mut todo = vec![(root_file.to_owned(), Vec::new())];
    while let Some((file, module)) = todo.pop() {
        let scanned = scan(&read(&file), &module);
        for child in &scanned.files {
            let base = dir.join(child.join("/"));
            let path = [base.with_extension("rs"), base.join("mod.rs")]
                .into_iter()
                .find(|p| p.exists())
                .unwrap_or_else(|| panic!("{}: `mod {}` has no file", file.display(), child.join("::")));
            todo.push((path, child.clone()));
        }
        out.push((file, module, scanned));
    }
    out
}

/// The imports between the children of module `parent` (`[]`: the top-level modules) in the
/// crate whose root is `root_file`, a child and its own children counting as one, each with
/// where it is made (`file:line`). A path counts when it reaches into a child, or to a name
/// `parent` takes from one (`crate::Executor` from `pub use executor::Executor` at the root,
/// `super::LoadError` from the parent's `pub use load::LoadError`).
fn module_edges(root_file: &Path, parent: &[String]) -> BTreeMap<String, BTreeMap<String, Vec<String>>> {
    let files = crate_files(root_file);
    sibling_edges(&files, parent)
}

/// Every module of the crate that has modules of its own, the root (`[]`) included.
fn parents(files: &[(PathBuf, Vec<String>, Scan)]) -> BTreeSet<Vec<String>> {
    files
        .iter()
        .flat_map(|(_, _, s)| s.files.iter().chain(&s.inline))
        .flat_map(|m| (0..m.len()).map(|n| m[..n].to_vec()))
        .collect()
}

/// [`module_edges`] over files already read.
fn sibling_edges(
    files: &[(PathBuf, Vec<String>, Scan)],
    parent: &[String],
) -> BTreeMap<String, BTreeMap<String, Vec<String>>> {
    let child_of = |path: &[String]| path.strip_prefix(parent).and_then(|rest| rest.first().cloned());
    let children: BTreeSet<String> =
        files.iter().flat_map(|(_, _, s)| s.files.iter().chain(&s.inline)).filter_map(|m| child_of(m)).collect();
    let parent_names: BTreeMap<String, String> = files
        .iter()
        .flat_map(|(_, _, s)| &s.names)
        .filter(|(from, _, _)| from == parent)
        .filter_map(|(_, name, path)| Some((name.clone(), child_of(path).filter(|m| children.contains(m))?)))
        .collect();
    let mut edges: BTreeMap<String, BTreeMap<String, Vec<String>>> = BTreeMap::new();
    for (file, _, scanned) in files {
        let place = file.strip_prefix(root()).unwrap_or(file).display().to_string();
        for r in &scanned.references {
            let (Some(from), Some(first)) = (child_of(&r.from), child_of(&r.to)) else { continue };
            let Some(to) = children.get(&first).or_else(|| parent_names.get(&first)) else { continue };
            if *to != from {
                let places = edges.entry(from.clone()).or_default().entry(to.clone()).or_default();
                let here = format!("{place}:{}", r.line);
                // One line may name several paths into the module (`use crate::a::{B, C};`).
                if places.last() != Some(&here) {
                    places.push(here);
                }
            }
        }
    }
    edges
}

/// A circle in `edges`, if there is one, as the modules along it.
fn find_circle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(start) = path.iter().position(|n| n == node) {
            let mut circle = path[start..].to_vec();
            circle.push(node.to_owned());
            return Some(circle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in edges.get(node).into_iter().flatten() {
            if let Some(circle) = visit(next, edges, path, done) {
                return Some(circle);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    edges.keys().find_map(|node| visit(node, edges, &mut Vec::new(), &mut done))
}

/// `text` up to its unit tests, without comments: a doc link is not an import.
fn code_of(text: &str) -> String {
    let code = text.split("#[cfg(test)]").next().unwrap_or("");
    code.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n")
}

/// Every crate's `src/` folder (the crate root file decides the modules).
fn source_folders() -> Vec<PathBuf> {
    let root = root();
    let mut folders: Vec<PathBuf> = std::fs::read_dir(root.join("crates"))
        .expect("crates/")
        .map(|e| e.expect("an entry").path().join("src"))
        .filter(|p| p.is_dir())
        .collect();
    folders.push(root.join("src-tauri/src"));
    folders.sort();
    folders
}

/// Every crate root: each crate's library and binaries, and the app's.
fn crate_roots() -> Vec<PathBuf> {
    let mut roots = Vec::new();
    for src in source_folders() {
        roots.extend(["lib.rs", "main.rs"].iter().map(|f| src.join(f)).filter(|p| p.exists()));
        if src.join("bin").is_dir() {
            roots.extend(rust_files(&src.join("bin")).into_iter().filter(|f| f.parent() == Some(&src.join("bin"))));
        }
    }
    roots
}

#[test]
fn no_crate_has_an_import_circle_between_its_modules() {
    let mut circles = Vec::new();
    for root_file in crate_roots() {
        let files = crate_files(&root_file);
        for parent in parents(&files) {
            let edges = sibling_edges(&files, &parent);
            let names: BTreeMap<String, BTreeSet<String>> =
                edges.iter().map(|(from, to)| (from.clone(), to.keys().cloned().collect())).collect();
            if let Some(circle) = find_circle(&names) {
                let under = if parent.is_empty() { String::new() } else { format!(" (in {})", parent.join("::")) };
                let shown = root_file.strip_prefix(root()).unwrap_or(&root_file).display();
                let mut report = format!("{shown}{under}: {}", circle.join(" → "));
                for pair in circle.windows(2) {
                    let places = &edges[&pair[0]][&pair[1]];
                    report.push_str(&format!("\n  {} → {}: {}", pair[0], pair[1], places.join(", ")));
                }
                circles.push(report);
            }
        }
    }
    assert!(circles.is_empty(), "import circles between modules:\n{}", circles.join("\n"));
}

/// The paths `text` names, as `from: to` (`from` left out when it is `module`), for the file of
/// `module`.
fn references(text: &str, module: &[&str]) -> Vec<String> {
    let module: Vec<String> = module.iter().map(|m| m.to_string()).collect();
    scan(text, &module)
        .references
        .into_iter()
        .map(|r| if r.from == module { r.to.join("::") } else { format!("{}: {}", r.from.join("::"), r.to.join("::")) })
        .collect()
}

#[test]
fn the_import_reader_reads_nested_groups_over_many_lines() {
    let text = "use crate::{\n    a::{b, c::{D, E as F}},\n    g,\n    h::*,\n};\nuse crate::i::{self, J};";
    assert_eq!(references(text, &["x"]), ["a::b", "a::c::D", "a::c::E", "g", "h", "i", "i::J"]);
}

#[test]
fn the_import_reader_resolves_super_and_self_from_the_files_module() {
    // In a top-level module, `super` is the crate root.
    assert_eq!(references("use super::{jobs::Job, Harness};", &["harness"]), ["jobs::Job", "Harness"]);
    // In a child, its parent, and so on up.
    assert_eq!(
        references("use super::{jobs::Job, Harness};", &["harness", "run_one"]),
        ["harness::jobs::Job", "harness::Harness"]
    );
    assert_eq!(references("use super::super::store::Store;", &["harness", "run_one"]), ["store::Store"]);
    assert_eq!(references("use self::inner::Q;", &["x"]), ["x::inner::Q"]);
    // Past the root is no path.
    assert!(references("use super::nothing;", &[]).is_empty());
}

#[test]
fn the_import_reader_reads_paths_inline_in_code() {
    let text = "fn f() -> crate::a::T {\n    let s = crate::sandbox::Limits::default();\n    super::b::g(self::c::H);\n    crate::d::<u8>();\n}";
    assert_eq!(references(text, &["x"]), ["a::T", "sandbox::Limits::default", "b::g", "x::c::H", "d"]);
}

#[test]
fn the_import_reader_skips_comments_literals_macro_paths_and_unit_tests() {
    let text = r##"
//! See [`crate::a`].
/* crate::b /* nested */ crate::c */
const S: &str = "crate::d \" crate::e";
const R: &str = r#"crate::f " crate::g"#;
const C: char = '{';
const Q: char = '\'';
fn f<'a>(x: &'a str) -> &'a str { x }
macro_rules! m { () => { $crate::h::I }; }
use baton_crate::j;
#[cfg(test)]
#[allow(dead_code)]
fn helper() -> crate::k::L { todo!() }
#[cfg(test)]
mod tests {
    use crate::l;
}
use crate::m::N;
"##;
    assert_eq!(references(text, &["x"]), ["m::N"]);
    // A file that is all unit tests.
    assert!(references("//! Tests.\n#![cfg(test)]\nuse crate::a;", &["x"]).is_empty());
}

#[test]
fn the_import_reader_follows_inline_modules_and_mod_declarations() {
    let text = "mod inner {\n    use super::y;\n    use super::super::z;\n}\nuse super::w;\npub mod child;\n#[cfg(test)]\nmod tests;";
    let scanned = scan(text, &["x".to_owned()]);
    let found: Vec<(String, String, usize)> =
        scanned.references.iter().map(|r| (r.from.join("::"), r.to.join("::"), r.line)).collect();
    assert_eq!(
        found,
        [
            ("x::inner".to_owned(), "x::y".to_owned(), 2),
            ("x::inner".to_owned(), "z".to_owned(), 3),
            ("x".to_owned(), "w".to_owned(), 5)
        ]
    );
    assert_eq!(scanned.files, [vec!["x".to_owned(), "child".to_owned()]]);
    assert_eq!(scanned.inline, [vec!["x".to_owned(), "inner".to_owned()]]);
}

#[test]
fn the_import_reader_knows_what_the_crate_root_brings_in() {
    let scanned = scan("pub use executor::{Executor as Exec, step::{Step}};\nuse std::sync::Arc;", &[]);
    let names: Vec<(String, String)> = scanned.names.iter().map(|(_, n, p)| (n.clone(), p.join("::"))).collect();
    assert_eq!(
        names,
        [
            ("Exec".to_owned(), "executor::Executor".to_owned()),
            ("Step".to_owned(), "executor::step::Step".to_owned()),
            ("Arc".to_owned(), "std::sync::Arc".to_owned())
        ]
    );
}

#[test]
fn the_circle_check_finds_a_circle_through_groups_super_and_root_names() {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let files = [
        ("lib.rs", "mod a;\nmod b;\nmod c;\npub use c::Thing;\n#[cfg(test)]\nmod tests;"),
        ("a.rs", "mod inner;"),
        // A child of `a` reaches `b` through `super` and a nested group.
        ("a/inner.rs", "use super::super::{b::{self, Other}};"),
        // `b` reaches `c` through a name the root re-exports, inline in code.
        ("b.rs", "pub struct Other;\nfn f() -> crate::Thing { todo!() }"),
        // `c` reaches back to `a` over many lines.
        ("c.rs", "pub struct Thing;\nuse crate::{\n    a,\n};"),
        // Unit tests reach anywhere, and are not read.
        ("tests.rs", "use crate::{a, b, c};"),
    ];
    for (name, text) in files {
        let path = dir.path().join(name);
        std::fs::create_dir_all(path.parent().expect("a folder")).expect("the folder is made");
        std::fs::write(path, text).expect("the file is written");
    }
    let edges = module_edges(&dir.path().join("lib.rs"), &[]);
    let names: BTreeMap<String, BTreeSet<String>> =
        edges.iter().map(|(from, to)| (from.clone(), to.keys().cloned().collect())).collect();
    assert_eq!(
        names,
        BTreeMap::from([
            ("a".to_owned(), BTreeSet::from(["b".to_owned()])),
            ("b".to_owned(), BTreeSet::from(["c".to_owned()])),
            ("c".to_owned(), BTreeSet::from(["a".to_owned()])),
        ])
    );
    assert!(edges["c"]["a"][0].ends_with("c.rs:2"), "{:?}", edges["c"]["a"]);
    assert_eq!(find_circle(&names).expect("a circle"), ["a", "b", "c", "a"]);
}

#[test]
fn the_circle_check_finds_a_circle_between_the_children_of_a_module() {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let files = [
        ("lib.rs", "mod engine;\nmod other;"),
        ("engine.rs", "mod load;\nmod memory;\npub use load::Config;\npub struct Model;"),
        // `load` reaches `memory`; `memory` reaches back through the name its parent re-exports.
        ("engine/load.rs", "pub struct Config;\nuse super::memory::need;\nuse super::Model;"),
        ("engine/memory.rs", "pub fn need(c: &super::Config) {}"),
        ("other.rs", "use crate::engine::Model;"),
    ];
    for (name, text) in files {
        let path = dir.path().join(name);
        std::fs::create_dir_all(path.parent().expect("a folder")).expect("the folder is made");
        std::fs::write(path, text).expect("the file is written");
    }
    let crate_files = crate_files(&dir.path().join("lib.rs"));
    assert_eq!(parents(&crate_files), BTreeSet::from([vec![], vec!["engine".to_owned()]]));
    let top = module_edges(&dir.path().join("lib.rs"), &[]);
    assert_eq!(top.keys().collect::<Vec<_>>(), ["other"], "{top:?}");
    let edges = module_edges(&dir.path().join("lib.rs"), &["engine".to_owned()]);
    let names: BTreeMap<String, BTreeSet<String>> =
        edges.iter().map(|(from, to)| (from.clone(), to.keys().cloned().collect())).collect();
    // `load` naming its parent's own `Model` is not an edge between siblings.
    assert_eq!(
        names,
        BTreeMap::from([
            ("load".to_owned(), BTreeSet::from(["memory".to_owned()])),
            ("memory".to_owned(), BTreeSet::from(["load".to_owned()])),
        ])
    );
    assert_eq!(find_circle(&names).expect("a circle"), ["load", "memory", "load"]);
}

#[test]
fn no_source_file_is_over_700_lines() {
    let generated = ["src-tauri/src/bindings.rs"];
    let mut long = Vec::new();
    for src in source_folders() {
        for file in rust_files(&src) {
            let rel = file.strip_prefix(root()).expect("under the root").to_string_lossy().into_owned();
            let lines = read(&file).lines().count();
            if lines > 700 && !generated.contains(&rel.as_str()) {
                long.push(format!("{rel}: {lines} lines"));
            }
        }
    }
    assert!(long.is_empty(), "split these by concern:\n{}", long.join("\n"));
}

/// Lines of `src/` files (outside unit tests) that contain `needle`, by file.
fn uses_of(needle: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for src in source_folders() {
        for file in rust_files(&src) {
            if code_of(&read(&file)).contains(needle) {
                out.insert(file.strip_prefix(root()).expect("under the root").to_string_lossy().into_owned());
            }
        }
    }
    out
}

#[test]
fn only_the_local_model_module_touches_the_inference_engine() {
    let engine =
        |f: &String| f == "crates/baton-local/src/engine.rs" || f.starts_with("crates/baton-local/src/engine/");
    assert!(uses_of("mistralrs::").iter().any(engine), "baton-local's engine module runs models through mistral.rs");
    // mistral.rs and candle, its tensor library.
    for needle in ["mistralrs::", "candle_core::"] {
        let outside: Vec<String> = uses_of(needle).into_iter().filter(|f| !engine(f)).collect();
        assert!(outside.is_empty(), "`{needle}` outside baton-local's engine module: {outside:?}");
    }
}

#[test]
fn front_ends_build_executors_only_through_the_runner() {
    // The benches build executors of fake workers on purpose: they measure the executor itself.
    let benches = ["crates/baton-cli/src/bench/executor.rs", "crates/baton-cli/src/bench/serve.rs"];
    for needle in ["Executor::from_pool", "load_local_workers", ".with_planner("] {
        let outside: Vec<String> = uses_of(needle)
            .into_iter()
            .filter(|f| {
                !f.starts_with("crates/baton-engine/")
                    && !f.starts_with("crates/baton-conductor/")
                    && !f.starts_with("crates/baton-runner/")
                    && !benches.contains(&f.as_str())
            })
            .collect();
        assert!(outside.is_empty(), "`{needle}` outside the runner: {outside:?}");
    }
}

#[test]
fn front_ends_learn_evaluate_serve_and_record_only_through_the_application_layer() {
    // The serve and flood benches build a server of fake workers on purpose: they measure the
    // server itself.
    let benches = ["crates/baton-cli/src/bench/serve.rs", "crates/baton-cli/src/bench/flood.rs"];
    let needles = [
        "Harness::new",
        "Service::new",
        "ServeOptions {",
        "leave_out_learned",
        "sampling_pool",
        "run_kept",
        "learned_items",
        "Strategy::parse_list",
    ];
    for needle in needles {
        let in_front_ends: Vec<String> = uses_of(needle)
            .into_iter()
            .filter(|f| {
                (f.starts_with("crates/baton-cli/") || f.starts_with("src-tauri/")) && !benches.contains(&f.as_str())
            })
            .collect();
        assert!(in_front_ends.is_empty(), "`{needle}` in a front end, not the application layer: {in_front_ends:?}");
    }
}
