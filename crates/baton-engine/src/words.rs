//! A text's words as the plan check and routing compare them: lower case, letters and digits
//! only, and the words too common to tell one question from another.

/// Words too common to tell one question from another: English's own, and the words any
/// instruction uses whatever its subject (what a function returns, units of time, signs,
/// logarithms), which a plan for the user's question says without having read an example.
pub(crate) const COMMON: &[&str] = &[
    "the", "and", "for", "are", "but", "not", "you", "all", "any", "can", "has", "have", "had", "was", "its", "our",
    "with", "that", "this", "these", "those", "from", "into", "than", "then", "when", "what", "which", "who", "whom",
    "why", "how", "many", "much", "does", "did", "will", "would", "should", "could", "each", "every", "other", "one",
    "two", "three", "four", "five", "first", "second", "last", "more", "most", "less", "least", "larger", "smaller",
    "write", "python", "function", "code", "program", "number", "numbers", "answer", "question", "give", "explain",
    "find", "value", "time", "about", "there", "their", "them", "they", "such", "some", "only", "also", "over",
    "return", "returns", "returned", "log", "logs", "positive", "negative", "minute", "minutes", "hour", "hours",
    "seconds", "day", "days", "make", "makes", "made", "up", "per", "total", "sum", "result", "results", "step",
    "steps", "list", "count", "check", "compare", "final", "correct", "option", "options", "letter", "choose",
];

/// Lower-case words of letters and digits; everything else separates them.
pub(crate) fn words(text: &str) -> Vec<String> {
    text.split(|c: char| !c.is_alphanumeric()).filter(|w| !w.is_empty()).map(str::to_lowercase).collect()
}
