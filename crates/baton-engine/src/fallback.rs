//! One worker alone, asked the question verbatim: when the conductor's plans cannot be used
//! ([`crate::plan_check`]), the worker [`fallback_worker`] names; when what the pool learned
//! routes the question ([`crate::routing::route`]), the worker it names. The run says which, and
//! why, in `PlanReady::fallback`.

use crate::learned::Measured;
use crate::pool::FallbackOptions;
use crate::routing::learned_worker;
pub use crate::workflow::{alone_plan, alone_subtask};

/// Which worker answers alone when the plans cannot be used, and why that one (`None`: no
/// measurement chose it). The user's `fallback_worker` first; then what the pool learned
/// (`learned`, [`crate::Pool::learned`]) names for the question ([`learned_worker`]); else the
/// first worker.
pub fn fallback_worker(
    options: &FallbackOptions,
    learned: &Measured,
    workers: usize,
    question: &str,
) -> (usize, Option<String>) {
    if let Some(w) = options.worker.filter(|w| *w < workers) {
        return (w, None);
    }
    learned_worker(learned, workers, question).map_or((0, None), |(w, why)| (w, Some(why)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::learned::Choices;
    use crate::routing::category_of;
    use baton_providers::Message;

    #[test]
    fn the_fallback_goes_to_the_best_worker_for_the_questions_category() {
        let measured = Measured {
            best: Some(0),
            by_category: Choices { best: [("chemistry".to_owned(), 2)].into(), ..Default::default() },
            questions: vec![
                ("What is the pH of a 0.01 M solution of hydrochloric acid?".into(), "chemistry".into()),
                ("Which gas is released when zinc reacts with hydrochloric acid?".into(), "chemistry".into()),
                ("Who wrote the Federalist Papers with Madison and Jay?".into(), "history".into()),
            ],
            ..Default::default()
        };
        let mut options = FallbackOptions::default();
        let acid = "What is the pH of a 0.1 M solution of acetic acid?";
        let (w, why) = fallback_worker(&options, &measured, 3, acid);
        assert_eq!(w, 2);
        assert!(why.unwrap().contains("chemistry"));
        // A question like none evaluated goes to the best worker overall.
        assert_eq!(category_of("Translate 'good morning' into French.", &measured.questions), None);
        assert_eq!(fallback_worker(&options, &measured, 3, "Translate 'good morning' into French.").0, 0);
        // A category's best that this pool does not have (a removed worker) is not used.
        assert_eq!(fallback_worker(&options, &measured, 2, acid).0, 0);
        // The user's choice wins over any measurement.
        options.worker = Some(1);
        assert_eq!(fallback_worker(&options, &measured, 3, acid), (1, None));
        // Nothing measured, nothing chosen: the first worker.
        assert_eq!(fallback_worker(&FallbackOptions::default(), &Measured::default(), 3, acid), (0, None));
    }

    #[test]
    fn a_worker_alone_gets_the_question_and_the_conversation() {
        assert_eq!(alone_subtask(&[], "Why?"), "Why?");
        let history = vec![Message::user("Hi"), Message::assistant("Hello")];
        let text = alone_subtask(&history, "Why?");
        assert!(text.contains("User: Hi\n") && text.contains("Assistant: Hello\n"), "{text}");
        assert!(text.ends_with("Answer the user's new message:\n\nWhy?"));
        let p = alone_plan(2, &[], "Why?");
        assert_eq!((p.steps.len(), p.steps[0].model_id, p.steps[0].subtask.as_str()), (1, 2, "Why?"));
    }
}
