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

/// Each workspace crate's normal dependencies on other workspace crates, from `cargo metadata`.
fn workspace_dependencies() -> BTreeMap<String, BTreeSet<String>> {
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
                // Normal dependencies only: tests may use anything.
                .filter(|d| d["kind"].is_null())
                .filter_map(|d| d["name"].as_str())
                .filter(|d| members.contains(*d))
                .map(str::to_owned)
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
    for (name, deps) in &actual {
        let (layer, allowed) = &table[name];
        assert_eq!(
            deps, allowed,
            "{name}: its Cargo.toml's workspace dependencies differ from ARCHITECTURE.md's layer table"
        );
        for dep in deps {
            let (below, _) = table[dep];
            assert!(below < *layer, "{name} (layer {layer}) depends on {dep} (layer {below}): not a lower layer");
        }
    }
}

/// The top-level module a path inside a crate's `src/` belongs to (`executor/step.rs` →
/// `executor`); `None` for the crate root.
fn top_module(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).expect("a file under src");
    let first = rel.components().next()?.as_os_str().to_str()?.trim_end_matches(".rs").to_owned();
    (!matches!(first.as_str(), "lib" | "main")).then_some(first)
}

/// `crate::name` paths in `text`, with the item names in `use crate::{a, b::c}` groups.
fn crate_paths(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, _) in text.match_indices("crate::") {
        // `$crate::` and `baton_crate::` are other paths.
        if text[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == '$') {
            continue;
        }
        let rest = &text[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let inner = &group[..group.find('}').unwrap_or(group.len())];
            out.extend(inner.split(',').map(|p| p.trim().split("::").next().unwrap_or("").to_owned()));
        } else {
            out.push(rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect());
        }
    }
    out.retain(|p| !p.is_empty());
    out
}

/// Which module an item the crate root re-exports comes from (`pub use executor::{Executor, …}`).
fn root_reexports(root_file: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for statement in root_file.split(';') {
        let Some(path) = statement.trim().strip_prefix("pub use ") else { continue };
        let Some((module, items)) = path.split_once("::") else { continue };
        let items = items.trim().trim_start_matches('{').trim_end_matches('}');
        for item in items.split(',') {
            let name = item.split(" as ").last().unwrap_or("").trim();
            if !name.is_empty() {
                out.insert(name.to_owned(), module.trim().to_owned());
            }
        }
    }
    out
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

#[test]
fn no_crate_has_an_import_circle_between_its_modules() {
    let mut circles = Vec::new();
    for src in source_folders() {
        let root_file = ["lib.rs", "main.rs"].iter().map(|f| src.join(f)).find(|p| p.exists()).expect("a crate root");
        let reexports = root_reexports(&read(&root_file));
        let files = rust_files(&src);
        let modules: BTreeSet<String> = files.iter().filter_map(|f| top_module(&src, f)).collect();
        let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for file in &files {
            let Some(from) = top_module(&src, file) else { continue };
            // Unit tests may reach anywhere in their crate.
            for path in crate_paths(&code_of(&read(file))) {
                let to = if modules.contains(&path) { Some(path) } else { reexports.get(&path).cloned() };
                if let Some(to) = to.filter(|to| *to != from) {
                    edges.entry(from.clone()).or_default().insert(to);
                }
            }
        }
        if let Some(circle) = find_circle(&edges) {
            circles.push(format!("{}: {}", src.display(), circle.join(" → ")));
        }
    }
    assert!(circles.is_empty(), "import circles between modules:\n{}", circles.join("\n"));
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
    let users = uses_of("mistralrs::");
    assert_eq!(users, BTreeSet::from(["crates/baton-conductor/src/local.rs".to_owned()]));
}

#[test]
fn front_ends_build_executors_only_through_the_runner() {
    // The benches build executors of fake workers on purpose: they measure the executor itself.
    let benches = ["crates/baton-cli/src/bench/executor.rs", "crates/baton-cli/src/bench/serve.rs"];
    for needle in ["Executor::from_pool", "attach_local_workers", ".with_planner("] {
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
