//! Maps a byte offset in a TOML document to its line and dotted key path.
//!
//! toml reports where an error is as a byte span; users want `node[1].address` and a line
//! number. This scanner follows `[table]` and `[[array]]` headers line by line, which is all a
//! cluster file uses (no inline tables are needed to write one).

use std::collections::HashMap;

/// Returns the 1-based line holding byte `offset` and the dotted key path at that point.
///
/// Array-of-tables entries are numbered from 0 in file order: the second `[[node]]` is `node[1]`.
pub fn key_at(text: &str, offset: usize) -> (usize, String) {
    let offset = offset.min(text.len());
    let mut table = String::new();
    let mut array_counts: HashMap<String, usize> = HashMap::new();
    let mut last_key: Option<String> = None;
    let mut line_no = 0;
    let mut start = 0;
    for line in text.split_inclusive('\n') {
        line_no += 1;
        let end = start + line.len();
        let trimmed = strip_comment(line).trim();
        if let Some(name) = trimmed
            .strip_prefix("[[")
            .and_then(|r| r.strip_suffix("]]"))
        {
            let name = unquote_path(name);
            let count = array_counts.entry(name.clone()).or_insert(0);
            table = format!("{name}[{count}]");
            *count += 1;
            last_key = None;
        } else if let Some(name) = trimmed
            .strip_prefix('[')
            .and_then(|r| r.strip_suffix(']'))
            .filter(|n| !n.contains(['[', ']']))
        {
            table = unquote_path(name);
            last_key = None;
        } else if trimmed.starts_with('[') {
            // A malformed header: the error is about the header itself, not the previous key.
            last_key = None;
        } else if let Some((key, _)) = trimmed.split_once('=') {
            last_key = Some(unquote_path(key));
        }
        if offset < end || end == text.len() {
            let key = match (&last_key, table.is_empty()) {
                (Some(k), true) => k.clone(),
                (Some(k), false) => format!("{table}.{k}"),
                (None, _) => table.clone(),
            };
            return (line_no, key);
        }
        start = end;
    }
    (line_no.max(1), table)
}

fn strip_comment(line: &str) -> &str {
    // A `#` inside a quoted string is not a comment; cluster files rarely have one, but an
    // address like "host#1" must not confuse the key we report.
    let mut in_string = false;
    for (i, c) in line.char_indices() {
        match c {
            '"' => in_string = !in_string,
            '#' if !in_string => return &line[..i],
            _ => {}
        }
    }
    line
}

fn unquote_path(path: &str) -> String {
    path.split('.')
        .map(|part| part.trim().trim_matches('"').trim_matches('\''))
        .collect::<Vec<_>>()
        .join(".")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follows_tables_and_arrays() {
        let text = "[cluster]\nname = \"x\"\n\n[[node]]\nname = \"a\"\n[[node]]\nname = \"b\"\naddress = \"nope\"\n";
        let at = text.find("\"nope\"").unwrap();
        assert_eq!(key_at(text, at), (8, "node[1].address".to_string()));
        let at = text.find("name = \"x\"").unwrap();
        assert_eq!(key_at(text, at), (2, "cluster.name".to_string()));
        let at = text.find("[[node]]").unwrap();
        assert_eq!(key_at(text, at), (4, "node[0]".to_string()));
    }

    #[test]
    fn ignores_hashes_in_strings() {
        let text = "[a]\nk = \"x#y\" # note\n";
        assert_eq!(key_at(text, 6), (2, "a.k".to_string()));
    }
}
