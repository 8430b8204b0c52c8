//! The import graph of `src/` has no cycle: neither between files nor between folders.
//!
//! Owns the reading of the crate's own sources as a graph, and the two assertions over it.
//! Every `.rs` file under `src/` is a node, found by following the `mod x;` declarations
//! from `lib.rs` and `main.rs` (so a file added later is in the graph with nothing to
//! register; one that no declaration reaches fails the test rather than go unseen). An
//! edge A → B says that A names something B defines: `use crate::…`, `use super::…`,
//! `use self::…`, a `use` of a child module, `use crate::{…}` groups, `lockstep::…` in
//! the binary, and the same paths written inline in code (`crate::units::human(…)`).
//! A name a module re-exports (`pub use x::Y`) is followed to the file that defines it,
//! so `crate::train::TrainConfig` is an edge to `train/config.rs`, not to `train/mod.rs`.
//! A module's own children are part of it: what its file names of them (declaring,
//! re-exporting or calling them) is not an edge, and they name its items with `super::`.
//! A cycle through a module's children and another module is still one at folder level.
//!
//! What is not part of the graph: comments (doc links included), string literals, and
//! every `#[cfg(test)]` item (a test may import anything); paths outside the crate.
//!
//! The folder graph merges every file under `src/<folder>/` into one node `<folder>/`;
//! a top-level file is its own node (`error.rs`, `memory.rs`). The binary's root
//! `main.rs` holds what its subcommands in `cmd/` share, and they take it with
//! `use crate::*`: a crate root is the top of its crate, and an edge into it is not
//! counted (in the library no file names `lib.rs`: `crate::Error` is followed to
//! `error.rs`).
//!
//! The text is read with regular expressions over comment- and literal-free source, not
//! with a Rust parser: enough for the paths this crate writes, and the self-checks at the
//! bottom hold the reader to a few known edges so that it cannot silently see nothing.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::Path;

use regex::Regex;

/// Which crate a module belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Crate {
    Lib,
    Bin,
}

/// One file module.
#[derive(Debug)]
struct Module {
    /// Path below `src/`, e.g. `exchange/shm.rs`.
    file: String,
    krate: Crate,
    /// Module path from the crate root (empty for the root).
    path: Vec<String>,
    parent: Option<usize>,
    children: BTreeMap<String, usize>,
    /// The source with comments, literals and `#[cfg(test)]` items blanked.
    text: String,
    /// Names this file defines (items, inline modules, enum-free: enough to stop a lookup).
    defines: BTreeSet<String>,
    /// Names bound by its `use` declarations: name → absolute path in `krate` (None: outside).
    aliases: BTreeMap<String, Option<(Crate, Vec<String>)>>,
    /// Targets of its glob imports, absolute.
    globs: Vec<(Crate, Vec<String>)>,
}

/// One `use` leaf: the path as written, what it binds, whether it is a glob.
#[derive(Debug)]
struct UseLeaf {
    path: Vec<String>,
    bound: Option<String>,
    glob: bool,
}

/// The graph: file modules and edges between them (indices into `modules`).
struct Graph {
    modules: Vec<Module>,
    edges: BTreeSet<(usize, usize)>,
}

// ---------------------------------------------------------------------------------------
// Reading the text

/// The source with comments and the contents of string and char literals replaced by
/// spaces (newlines kept), so that nothing in them looks like a path or a brace.
fn strip(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let blank =
        |out: &mut Vec<u8>, bytes: &[u8]| out.extend(bytes.iter().map(|&c| if c == b'\n' { b'\n' } else { b' ' }));
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == b'/' && next == Some(b'/') {
            let end = b[i..].iter().position(|&c| c == b'\n').map_or(b.len(), |p| i + p);
            blank(&mut out, &b[i..end]);
            i = end;
        } else if c == b'/' && next == Some(b'*') {
            let (mut depth, mut j) = (1, i + 2);
            while j < b.len() && depth > 0 {
                if b[j] == b'/' && b.get(j + 1) == Some(&b'*') {
                    depth += 1;
                    j += 2;
                } else if b[j] == b'*' && b.get(j + 1) == Some(&b'/') {
                    depth -= 1;
                    j += 2;
                } else {
                    j += 1;
                }
            }
            blank(&mut out, &b[i..j]);
            i = j;
        } else if (c == b'r' || (c == b'b' && next == Some(b'r')))
            && !prev_is_ident(b, i)
            && raw_string_start(b, if c == b'b' { i + 2 } else { i + 1 }).is_some()
        {
            let from = if c == b'b' { i + 2 } else { i + 1 };
            let hashes = raw_string_start(b, from).unwrap();
            let body = from + hashes + 1;
            let mut closing = vec![b'"'];
            closing.extend(std::iter::repeat_n(b'#', hashes));
            let end = b[body..]
                .windows(closing.len())
                .position(|w| w == closing.as_slice())
                .map_or(b.len(), |p| body + p + closing.len());
            out.push(b'"');
            blank(&mut out, &b[i + 1..end.saturating_sub(1)]);
            out.push(b'"');
            i = end;
        } else if c == b'"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != b'"' {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            out.push(b'"');
            blank(&mut out, &b[i + 1..j.min(b.len())]);
            out.push(b'"');
            i = j + 1;
        } else if c == b'\'' {
            // A char literal ('x', '\n', '\u{..}', '"') or a lifetime ('a): a literal closes
            // within a few bytes, a lifetime does not close.
            let close = if next == Some(b'\\') {
                b[i + 2..].iter().take(12).position(|&c| c == b'\'').map(|p| i + 2 + p)
            } else {
                let len = src[i + 1..].chars().next().map_or(1, char::len_utf8);
                (b.get(i + 1 + len) == Some(&b'\'')).then_some(i + 1 + len)
            };
            match close {
                Some(end) => {
                    out.push(b'\'');
                    blank(&mut out, &b[i + 1..end]);
                    out.push(b'\'');
                    i = end + 1;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    String::from_utf8(out).expect("only ASCII bytes were replaced")
}

fn prev_is_ident(b: &[u8], i: usize) -> bool {
    i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')
}

/// At `from`: `#`* then `"` — a raw string's opening; the number of `#`.
fn raw_string_start(b: &[u8], from: usize) -> Option<usize> {
    let hashes = b[from.min(b.len())..].iter().take_while(|&&c| c == b'#').count();
    (b.get(from + hashes) == Some(&b'"')).then_some(hashes)
}

/// Blanks every item that carries `#[cfg(test)]`: up to its `;`, or its braces' end.
fn drop_test_items(text: &str) -> String {
    let attr = Regex::new(r"#\s*\[\s*cfg\s*\(\s*test\s*\)\s*\]").unwrap();
    let mut out = text.as_bytes().to_vec();
    for m in attr.find_iter(text) {
        let b = text.as_bytes();
        let mut j = m.end();
        let mut depth = 0usize;
        while j < b.len() {
            match b[j] {
                b'{' => depth += 1,
                b'}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        j += 1;
                        break;
                    }
                }
                b';' if depth == 0 => {
                    j += 1;
                    break;
                }
                _ => {}
            }
            j += 1;
        }
        for c in &mut out[m.start()..j.min(b.len())] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
    }
    String::from_utf8(out).unwrap()
}

/// Every `use` declaration of the text, with its span.
fn use_decls(text: &str) -> Vec<(std::ops::Range<usize>, Vec<UseLeaf>)> {
    let start = Regex::new(r"(?m)(^|[;{}\]\s])((pub(\s*\([^)]*\))?\s+)?)use\s").unwrap();
    let mut out = Vec::new();
    for c in start.captures_iter(text) {
        let whole = c.get(0).unwrap();
        let from = c.get(2).unwrap().start();
        let Some(len) = text[whole.end()..].find(';') else { continue };
        let body = &text[whole.end()..whole.end() + len];
        let leaves = parse_use_tree(body);
        out.push((from..whole.end() + len + 1, leaves));
    }
    out
}

/// `a::{b, c::{d as e, *}}` → `a::b`, `a::c::d` bound as `e`, the glob `a::c::*`.
fn parse_use_tree(body: &str) -> Vec<UseLeaf> {
    let token = Regex::new(r"::|[{},*]|[A-Za-z_][A-Za-z0-9_]*").unwrap();
    let tokens: Vec<&str> = token.find_iter(body).map(|m| m.as_str()).collect();
    let mut leaves = Vec::new();
    let mut at = 0;
    tree(&tokens, &mut at, Vec::new(), &mut leaves);
    leaves
}

fn tree(t: &[&str], at: &mut usize, mut prefix: Vec<String>, out: &mut Vec<UseLeaf>) {
    loop {
        match t.get(*at).copied() {
            Some("::") => *at += 1,
            Some("{") => {
                *at += 1;
                while !matches!(t.get(*at).copied(), Some("}") | None) {
                    tree(t, at, prefix.clone(), out);
                    if t.get(*at).copied() == Some(",") {
                        *at += 1;
                    }
                }
                *at += 1;
                return;
            }
            Some("*") => {
                *at += 1;
                out.push(UseLeaf { path: prefix, bound: None, glob: true });
                return;
            }
            Some(word) if word != "," && word != "}" => {
                *at += 1;
                prefix.push(word.to_string());
                if t.get(*at).copied() == Some("::") {
                    continue;
                }
                let mut bound = prefix.last().cloned();
                if t.get(*at).copied() == Some("as") {
                    bound = t.get(*at + 1).map(|s| s.to_string()).filter(|s| s != "_");
                    *at += 2;
                }
                if bound.as_deref() == Some("self") {
                    prefix.pop();
                    bound = prefix.last().cloned();
                }
                out.push(UseLeaf { path: prefix, bound, glob: false });
                return;
            }
            _ => return,
        }
    }
}

// ---------------------------------------------------------------------------------------
// The graph

impl Graph {
    /// The graph of the sources `files` (paths below `src/` → text).
    fn build(files: &BTreeMap<String, String>) -> Graph {
        let mod_decl =
            Regex::new(r"(?m)(^|[;{}\]\s])(pub(\s*\([^)]*\))?\s+)?mod\s+([A-Za-z_][A-Za-z0-9_]*)\s*;").unwrap();
        let item = Regex::new(
            r"\b(fn|struct|enum|trait|type|const|static|union|mod|macro_rules\s*!)\s+([A-Za-z_][A-Za-z0-9_]*)",
        )
        .unwrap();
        let mut modules: Vec<Module> = Vec::new();
        let mut queue = VecDeque::new();
        for (root, krate) in [("lib.rs", Crate::Lib), ("main.rs", Crate::Bin)] {
            if files.contains_key(root) {
                queue.push_back((root.to_string(), krate, Vec::<String>::new(), None::<usize>, false));
            }
        }
        while let Some((file, krate, path, parent, test_only)) = queue.pop_front() {
            let stripped = strip(&files[&file]);
            // A module declared under `#[cfg(test)]` is test code through and through: its
            // file, and the files it declares, name what they like.
            let text = if test_only { " ".repeat(stripped.len()) } else { drop_test_items(&stripped) };
            let me = modules.len();
            if let Some(p) = parent {
                modules[p].children.insert(path.last().unwrap().clone(), me);
            }
            // A root or a mod.rs declares children beside it; `a/b.rs` declares them in `a/b/`.
            let dir = match file.rsplit_once('/') {
                _ if file == "lib.rs" || file == "main.rs" => String::new(),
                Some((d, "mod.rs")) => format!("{d}/"),
                Some(_) | None => format!("{}/", file.trim_end_matches(".rs")),
            };
            for c in mod_decl.captures_iter(&stripped) {
                let name = c[4].to_string();
                let child = [format!("{dir}{name}.rs"), format!("{dir}{name}/mod.rs")]
                    .into_iter()
                    .find(|f| files.contains_key(f))
                    .unwrap_or_else(|| {
                        panic!("{file} declares `mod {name};` but neither {dir}{name}.rs nor {dir}{name}/mod.rs exists")
                    });
                let mut child_path = path.clone();
                child_path.push(name);
                // Blanked by drop_test_items: the declaration is a test item.
                let declared_for_tests = test_only || text[c.get(4).unwrap().range()].trim().is_empty();
                queue.push_back((child, krate, child_path, Some(me), declared_for_tests));
            }
            let defines = item.captures_iter(&text).map(|c| c[2].to_string()).collect();
            modules.push(Module {
                file,
                krate,
                path,
                parent,
                children: BTreeMap::new(),
                text,
                defines,
                aliases: BTreeMap::new(),
                globs: Vec::new(),
            });
        }
        let reached: BTreeSet<&str> = modules.iter().map(|m| m.file.as_str()).collect();
        let orphans: Vec<&String> = files.keys().filter(|f| !reached.contains(f.as_str())).collect();
        assert!(orphans.is_empty(), "no `mod` declaration reaches {orphans:?}");

        let mut graph = Graph { modules, edges: BTreeSet::new() };
        // First every module's bindings (the lookups of the second pass follow them).
        let mut decls = Vec::new();
        for m in 0..graph.modules.len() {
            let found = use_decls(&graph.modules[m].text);
            for (_, leaves) in &found {
                for leaf in leaves {
                    let abs = graph.absolute(m, &leaf.path);
                    if leaf.glob {
                        graph.modules[m].globs.extend(abs);
                    } else if let Some(name) = &leaf.bound {
                        graph.modules[m].aliases.insert(name.clone(), abs);
                    }
                }
            }
            decls.push(found);
        }
        let inline = Regex::new(r"(^|[^:A-Za-z0-9_])([A-Za-z_][A-Za-z0-9_]*)((::[A-Za-z_][A-Za-z0-9_]*)+)").unwrap();
        for (m, found) in decls.into_iter().enumerate() {
            let mut refs: Vec<Vec<String>> = Vec::new();
            let mut rest = graph.modules[m].text.clone().into_bytes();
            for (span, leaves) in found {
                rest[span].fill(b' ');
                refs.extend(leaves.into_iter().map(|l| l.path));
            }
            let rest = String::from_utf8(rest).unwrap();
            for c in inline.captures_iter(&rest) {
                let first = &c[2];
                let known = matches!(first, "crate" | "self" | "super" | "lockstep")
                    || graph.modules[m].children.contains_key(first);
                if known {
                    let mut path = vec![first.to_string()];
                    path.extend(c[3].split("::").filter(|s| !s.is_empty()).map(str::to_string));
                    refs.push(path);
                }
            }
            for path in refs {
                let Some((krate, abs)) = graph.absolute(m, &path) else { continue };
                let Some(to) = graph.resolve(krate, &abs, 0) else { continue };
                let own = graph.is_within(to, m);
                let root = graph.modules[to].parent.is_none();
                if !own && !root {
                    graph.edges.insert((m, to));
                }
            }
        }
        graph
    }

    /// `path` as written in module `m`, from its crate's root; None outside the crate.
    fn absolute(&self, m: usize, path: &[String]) -> Option<(Crate, Vec<String>)> {
        let me = &self.modules[m];
        let first = path.first()?;
        let mut base = match first.as_str() {
            "crate" => return Some((me.krate, path[1..].to_vec())),
            "lockstep" if me.krate == Crate::Bin => return Some((Crate::Lib, path[1..].to_vec())),
            "self" => me.path.clone(),
            "super" => me.path.clone(),
            name if me.children.contains_key(name) => {
                return Some((me.krate, [me.path.clone(), path.to_vec()].concat()))
            }
            _ => return None,
        };
        let mut i = 0;
        if first == "self" {
            i = 1;
        }
        while path.get(i).map(String::as_str) == Some("super") {
            base.pop()?;
            i += 1;
        }
        base.extend(path[i..].iter().cloned());
        Some((me.krate, base))
    }

    fn root(&self, krate: Crate) -> Option<usize> {
        self.modules.iter().position(|m| m.krate == krate && m.parent.is_none())
    }

    /// The file that defines what the absolute `path` names.
    fn resolve(&self, krate: Crate, path: &[String], depth: usize) -> Option<usize> {
        let mut at = self.root(krate)?;
        let mut i = 0;
        while let Some(&child) = path.get(i).and_then(|s| self.modules[at].children.get(s)) {
            at = child;
            i += 1;
        }
        let Some(name) = path.get(i) else { return Some(at) };
        let module = &self.modules[at];
        if depth > 16 || module.defines.contains(name) {
            return Some(at);
        }
        if let Some(target) = module.aliases.get(name) {
            return match target {
                Some((k, p)) => {
                    Some(self.resolve(*k, &[p.as_slice(), &path[i + 1..]].concat(), depth + 1).unwrap_or(at))
                }
                None => Some(at),
            };
        }
        for (k, glob) in &module.globs {
            let Some(g) = self.resolve(*k, glob, depth + 1) else { continue };
            let there = &self.modules[g];
            if there.defines.contains(name) || there.aliases.contains_key(name) || there.children.contains_key(name) {
                return Some(self.resolve(*k, &[glob.as_slice(), &path[i..]].concat(), depth + 1).unwrap_or(g));
            }
        }
        Some(at)
    }

    /// Whether module `m` is `ancestor` or below it.
    fn is_within(&self, mut m: usize, ancestor: usize) -> bool {
        loop {
            if m == ancestor {
                return true;
            }
            match self.modules[m].parent {
                Some(p) => m = p,
                None => return false,
            }
        }
    }

    fn file_edges(&self) -> BTreeMap<String, BTreeSet<String>> {
        let mut out: BTreeMap<String, BTreeSet<String>> =
            self.modules.iter().map(|m| (m.file.clone(), BTreeSet::new())).collect();
        for &(a, b) in &self.edges {
            out.get_mut(&self.modules[a].file).unwrap().insert(self.modules[b].file.clone());
        }
        out
    }

    fn folder_edges(&self) -> BTreeMap<String, BTreeSet<String>> {
        let mut out: BTreeMap<String, BTreeSet<String>> =
            self.modules.iter().map(|m| (node(&m.file), BTreeSet::new())).collect();
        for &(a, b) in &self.edges {
            let (a, b) = (node(&self.modules[a].file), node(&self.modules[b].file));
            if a != b {
                out.get_mut(&a).unwrap().insert(b);
            }
        }
        out
    }
}

/// The folder graph's node of a file: `exchange/shm.rs` → `exchange/`, `error.rs` → itself.
fn node(file: &str) -> String {
    match file.split_once('/') {
        Some((dir, _)) => format!("{dir}/"),
        None => file.to_string(),
    }
}

// ---------------------------------------------------------------------------------------
// Cycles

/// One cycle through every strongly connected component of more than one node, each as
/// `a → b → … → a`.
fn cycles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Cycle> {
    let reach = |from: &String| {
        let mut seen = BTreeSet::new();
        let mut queue: VecDeque<&String> = edges[from].iter().collect();
        while let Some(n) = queue.pop_front() {
            if seen.insert(n.clone()) {
                queue.extend(edges[n].iter());
            }
        }
        seen
    };
    let reaches: BTreeMap<&String, BTreeSet<String>> = edges.keys().map(|n| (n, reach(n))).collect();
    let mut done = BTreeSet::new();
    let mut out = Vec::new();
    for n in edges.keys() {
        if done.contains(n) || !reaches[n].contains(n) {
            continue;
        }
        let component: BTreeSet<String> = reaches[n].iter().filter(|m| reaches[*m].contains(n)).cloned().collect();
        done.extend(component.iter().cloned());
        // The shortest way back to n, inside its component.
        let mut from: BTreeMap<String, String> = BTreeMap::new();
        let mut queue = VecDeque::from([n.clone()]);
        'search: while let Some(a) = queue.pop_front() {
            for b in edges[&a].iter().filter(|b| component.contains(*b)) {
                if b == n {
                    from.insert(n.clone() + "#", a.clone());
                    break 'search;
                }
                if !from.contains_key(b) {
                    from.insert(b.clone(), a.clone());
                    queue.push_back(b.clone());
                }
            }
        }
        let mut path = vec![n.clone()];
        let mut at = from[&(n.clone() + "#")].clone();
        while &at != n {
            path.push(at.clone());
            at = from[&at].clone();
        }
        path.push(n.clone());
        path.reverse();
        out.push(Cycle { path, component });
    }
    out
}

/// A cycle, and the strongly connected component it was found in (every node of which
/// reaches every other: the cycle is one way round it).
#[derive(Debug)]
struct Cycle {
    path: Vec<String>,
    component: BTreeSet<String>,
}

fn describe(cycles: &[Cycle]) -> String {
    let one = |c: &Cycle| {
        let mut line = format!("  {}", c.path.join(" → "));
        if c.component.len() + 1 > c.path.len() {
            let all: Vec<&str> = c.component.iter().map(String::as_str).collect();
            line += &format!("\n    (one way round {} nodes that all reach each other: {})", all.len(), all.join(", "));
        }
        line
    };
    cycles.iter().map(one).collect::<Vec<_>>().join("\n")
}

/// Every `.rs` file under `dir`, by its path below `src/`.
fn read_sources(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            read_sources(root, &path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let name = path.strip_prefix(root).unwrap().to_string_lossy().replace('\\', "/");
            out.insert(name, std::fs::read_to_string(&path).unwrap());
        }
    }
}

fn crate_graph() -> Graph {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = BTreeMap::new();
    read_sources(&src, &src, &mut files);
    Graph::build(&files)
}

fn count_edges(edges: &BTreeMap<String, BTreeSet<String>>) -> usize {
    edges.values().map(BTreeSet::len).sum()
}

// ---------------------------------------------------------------------------------------
// The assertions

#[test]
fn no_file_imports_itself_through_others() {
    let edges = crate_graph().file_edges();
    println!("file graph: {} nodes, {} edges", edges.len(), count_edges(&edges));
    let found = cycles(&edges);
    assert!(found.is_empty(), "import cycles between files of src/:\n{}", describe(&found));
}

#[test]
fn no_folder_imports_itself_through_others() {
    let graph = crate_graph();
    let edges = graph.folder_edges();
    println!("folder graph: {} nodes, {} edges", edges.len(), count_edges(&edges));
    let found = cycles(&edges);
    // The file edges between the nodes of each component: the ones to break.
    let files = graph.file_edges();
    let mut why = String::new();
    for c in &found {
        for (a, to) in files.iter().filter(|(a, _)| c.component.contains(&node(a))) {
            for b in to.iter().filter(|b| node(b) != node(a) && c.component.contains(&node(b))) {
                why += &format!("\n  {a} → {b}");
            }
        }
    }
    assert!(found.is_empty(), "import cycles between folders of src/:\n{}\nby the files:{why}", describe(&found));
}

// ---------------------------------------------------------------------------------------
// The reader, held to what it must see

#[test]
fn the_reader_sees_the_crates_known_edges() {
    // Edges that this crate's sources write in each of the forms read; if the reader
    // missed a form, the graph would be emptier and the tests above would pass vacuously.
    let edges = crate_graph().file_edges();
    let has = |a: &str, b: &str| edges.get(a).is_some_and(|to| to.contains(b));
    assert!(has("exchange/shm.rs", "error.rs"), "use crate::error::{{...}}");
    assert!(has("exchange/shm.rs", "exchange/mod.rs"), "use super::{{Abort, ...}}");
    assert!(has("train/config.rs", "wire.rs"), "exchange::codec::Compression, followed through its re-export");
    assert!(has("cli/train/mod.rs", "cli/signals.rs"), "use super::signals::...");
    assert!(has("main.rs", "cli/mod.rs"), "lockstep::cli::main, from the binary");
    assert!(has("cli/mod.rs", "train/trainer.rs"), "crate::train::with_trainer, followed past the facade");
}

fn graph_of(files: &[(&str, &str)]) -> Graph {
    Graph::build(&files.iter().map(|(f, t)| (f.to_string(), t.to_string())).collect())
}

#[test]
fn a_cycle_is_found_and_printed_as_a_path() {
    let g = graph_of(&[
        ("lib.rs", "pub mod a; pub mod b; mod c;\npub use a::Thing;"),
        ("a.rs", "use crate::{b::{self, Other}, c::*};\npub struct Thing;"),
        ("b.rs", "pub struct Other;\nfn f() { let _ = crate::c::helper(); }"),
        ("c.rs", "// use crate::b; (a comment)\nconst S: &str = \"crate::b::x\";\npub fn helper() { crate::Thing; }"),
    ]);
    let found = cycles(&g.file_edges());
    assert_eq!(found.len(), 1, "{}", describe(&found));
    assert_eq!(found[0].path, ["a.rs", "c.rs", "a.rs"], "{}", describe(&found));
    assert_eq!(found[0].component.len(), 3, "{}", describe(&found));
    assert!(!g.file_edges()["c.rs"].contains("b.rs"), "comments and strings are not read");
}

#[test]
fn test_modules_and_facades_are_not_edges() {
    let g = graph_of(&[
        ("lib.rs", "pub mod x; pub mod y;"),
        ("x/mod.rs", "mod inner;\npub use inner::Deep;\npub trait T {}"),
        ("x/inner.rs", "use super::T;\npub struct Deep;\nfn f(c: char) -> bool { c == '{' }\n#[cfg(test)]\nmod tests { use crate::y::Y; }"),
        ("y.rs", "use crate::x::Deep;\npub struct Y<'a>(&'a str);"),
    ]);
    let e = g.file_edges();
    assert!(e["x/inner.rs"].contains("x/mod.rs"));
    assert!(!e["x/inner.rs"].contains("y.rs"), "a test module may import anything");
    assert!(e["x/mod.rs"].is_empty(), "a module's re-export of its own child is its facade");
    assert_eq!(e["y.rs"], BTreeSet::from(["x/inner.rs".to_string()]), "followed through the re-export");
    assert!(cycles(&e).is_empty() && cycles(&g.folder_edges()).is_empty());
}

// ---------------------------------------------------------------------------------------
// The layout map of the guide

#[test]
fn the_layout_map_names_every_entry_of_src_and_only_what_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/architecture.md")).unwrap();
    let after = doc.split("## Layout").nth(1).expect("the chapter's Layout section");
    let block = after.split("```text\n").nth(1).and_then(|b| b.split("```").next()).expect("its map");
    // The names the map writes: `src/<dir>/`, `<file>.rs` (bare, on a line of src's files,
    // or `src/<file>.rs`).
    let named: BTreeSet<String> = Regex::new(r"(?:src/)?[a-z_]+(?:/|\.rs)\b?")
        .unwrap()
        .find_iter(block)
        .map(|m| m.as_str().trim_start_matches("src/").to_string())
        .collect();
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(root.join("src")).unwrap().map(|e| e.unwrap()) {
        let name = entry.file_name().to_string_lossy().into_owned();
        let written = if entry.path().is_dir() { format!("{name}/") } else { name };
        if !named.contains(&written) {
            missing.push(written);
        }
    }
    assert!(missing.is_empty(), "src/ holds {missing:?}, which the layout map of docs/architecture.md does not name");
    for path in Regex::new(r"src/[a-z_/]+(?:\.rs)?").unwrap().find_iter(block).map(|m| m.as_str()) {
        assert!(root.join(path).exists(), "the layout map names {path}, which does not exist");
    }
}
