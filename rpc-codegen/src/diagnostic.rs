//! A `.proto` mistake as protoc and rustc show one: the message, then
//! `file:line:col`, the line and a caret under the place; for a file or an
//! import not found, the include paths searched.

use std::fmt;
use std::path::Path;

use miette::Diagnostic;

/// What [`crate::Builder::compile`] returns (inside an `io::Error` of kind
/// `InvalidInput`) when protox refuses the files. Its `Debug` is its
/// `Display`, so a `build.rs` whose `main` returns the error prints it as
/// it is, not escaped into one line.
pub(crate) struct ProtoError {
    rendered: String,
}

impl ProtoError {
    pub(crate) fn new(error: &protox::Error, includes: &[&Path]) -> ProtoError {
        let mut rendered = format!("error: {error}");
        // Notes line up with the `|` of the excerpt, as rustc's do.
        let mut note_indent = 1;
        if let Some((place, gutter)) = place(error) {
            rendered.push_str(&place);
            note_indent += gutter;
        } else if let Some(file) = error.file() {
            rendered.push_str(&format!("\n --> {file}"));
        }
        let indent = " ".repeat(note_indent);
        let not_found = error.is_file_not_found()
            || error.to_string().starts_with("import '")
            || error.to_string().contains("is not in any include path");
        if not_found {
            let searched: Vec<String> = includes
                .iter()
                .map(|include| format!("{}", include.display()))
                .collect();
            rendered.push_str(&format!(
                "\n{indent}= note: include paths searched: {}",
                if searched.is_empty() {
                    "none".to_owned()
                } else {
                    searched.join(", ")
                }
            ));
        }
        if let Some(help) = error.help() {
            rendered.push_str(&format!("\n{indent}= help: {help}"));
        }
        ProtoError { rendered }
    }
}

/// `--> file:line:col`, the line and a caret under the first label's span;
/// and the width of the line number's gutter.
fn place(error: &protox::Error) -> Option<(String, usize)> {
    let source = error.source_code()?;
    let label = error.labels()?.next()?;
    let span = label.inner();
    let contents = source.read_span(span, 0, 0).ok()?;
    let (line, column) = (contents.line() + 1, contents.column() + 1);
    let name = contents
        .name()
        .map(str::to_owned)
        .or_else(|| error.file().map(str::to_owned))
        .unwrap_or_else(|| "<input>".to_owned());
    // The whole line the span starts on: the span with a line of context
    // each side covers whole lines, from the line `around.line()`.
    let around = source.read_span(span, 1, 1).ok()?;
    let text = String::from_utf8_lossy(around.data());
    let first_line = text
        .lines()
        .nth(contents.line().checked_sub(around.line())?)
        .unwrap_or("");
    let gutter = line.to_string().len();
    let width = span
        .len()
        .max(1)
        .min(first_line.len().saturating_sub(column - 1).max(1));
    let mut out = format!(
        "\n{:gutter$}--> {name}:{line}:{column}\n{:gutter$} |\n{line} | {first_line}\n{:gutter$} | {}{}",
        "",
        "",
        "",
        " ".repeat(column - 1),
        "^".repeat(width),
    );
    if let Some(label) = label.label() {
        out.push(' ');
        out.push_str(label);
    }
    Some((out, gutter))
}

impl fmt::Display for ProtoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.rendered)
    }
}

impl fmt::Debug for ProtoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // On a line of its own: `main` prints `Error: Custom { kind:
        // InvalidInput, error: ` before it.
        writeln!(f)?;
        f.write_str(&self.rendered)
    }
}

impl std::error::Error for ProtoError {}
