//! An error with its chain of causes, as one line.

/// `error: cause: cause …` (each `source` in turn), without repeating a cause already
/// contained in the text before it. An `io::Error` wrapping another error shows the wrapped
/// error's text, then that error's causes.
pub fn causes(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut next = error.source();
    while let Some(cause) = next {
        let c = cause.to_string();
        if !text.contains(&c) {
            text.push_str(": ");
            text.push_str(&c);
        }
        next = cause.source();
    }
    text
}
