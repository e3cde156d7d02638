//! The TypeScript side of every type that crosses the IPC boundary, generated from the Rust
//! types (ts-rs) into `ui/src/bindings.ts`. The test below fails when the committed file is
//! stale; `UPDATE_BINDINGS=1 cargo test -p baton-desktop bindings` rewrites it.

use ts_rs::{Config, TS};

/// The whole bindings file.
pub fn typescript() -> String {
    // serde writes 64-bit integers as JSON numbers; ids and token counts stay far below 2^53.
    let cfg = Config::new().with_large_int("number");
    let decls = [
        baton_providers::ProviderKind::decl(&cfg),
        baton_providers::Role::decl(&cfg),
        baton_providers::Message::decl(&cfg),
        baton_providers::Usage::decl(&cfg),
        baton_plan::Plan::decl(&cfg),
        baton_plan::Access::decl(&cfg),
        baton_engine::WorkerInfo::decl(&cfg),
        baton_engine::StepRef::decl(&cfg),
        baton_engine::RerunOf::decl(&cfg),
        baton_engine::StepErrorKind::decl(&cfg),
        baton_engine::StepError::decl(&cfg),
        baton_engine::RunErrorKind::decl(&cfg),
        baton_engine::RunError::decl(&cfg),
        baton_engine::accounting::Figures::decl(&cfg),
        baton_engine::Totals::decl(&cfg),
        baton_engine::PlanPrompt::decl(&cfg),
        baton_engine::RunEvent::decl(&cfg),
        baton_store::RunStatus::decl(&cfg),
        baton_store::RunSummary::decl(&cfg),
        baton_store::ConversationSummary::decl(&cfg),
        baton_store::SearchHit::decl(&cfg),
        baton_store::RunTree::decl(&cfg),
        baton_store::RunRecord::decl(&cfg),
        baton_store::RejectedPlan::decl(&cfg),
        baton_store::PlanRecord::decl(&cfg),
        baton_store::StepRecord::decl(&cfg),
        baton_store::SentRequest::decl(&cfg),
        crate::error::ErrorKind::decl(&cfg),
        crate::error::KeyConsent::decl(&cfg),
        crate::error::AppError::decl(&cfg),
        crate::settings::WorkerForm::decl(&cfg),
        crate::settings::ConductorForm::decl(&cfg),
        crate::settings::PoolForm::decl(&cfg),
        crate::settings::Settings::decl(&cfg),
        crate::keys::KeyRow::decl(&cfg),
        crate::keys::KeysView::decl(&cfg),
        crate::chat::ModelLoad::decl(&cfg),
        crate::chat::AskRequest::decl(&cfg),
        crate::chat::AskResult::decl(&cfg),
        crate::chat::RerunRequest::decl(&cfg),
        crate::chat::Draft::decl(&cfg),
        crate::chat::ConnectionCheck::decl(&cfg),
        crate::history::ExportFormat::decl(&cfg),
        crate::history::ExportTarget::decl(&cfg),
        crate::AppInfo::decl(&cfg),
        crate::models::ModelChoice::decl(&cfg),
        crate::models::DownloadedModel::decl(&cfg),
        crate::models::ModelCatalog::decl(&cfg),
        crate::models::Download::decl(&cfg),
        baton_local::LoadedModel::decl(&cfg),
        baton_store::evaluations::Evaluation::decl(&cfg),
        baton_store::evaluations::EvalResult::decl(&cfg),
        baton_store::figures::WorkerFigures::decl(&cfg),
        baton_store::figures::WorkerAccuracy::decl(&cfg),
        baton_store::comparisons::Preferred::decl(&cfg),
        baton_store::comparisons::ChatComparison::decl(&cfg),
        crate::chat::CompareRequest::decl(&cfg),
        crate::chat::CompareResult::decl(&cfg),
        baton_eval::report::StrategySummary::decl(&cfg),
        baton_eval::report::Comparison::decl(&cfg),
        baton_eval::report::Report::decl(&cfg),
        crate::eval::SuiteInfo::decl(&cfg),
        crate::eval::EvalRequest::decl(&cfg),
        crate::eval::EvalProgress::decl(&cfg),
        crate::eval::EvalView::decl(&cfg),
        baton_engine::profile::CategoryFigures::decl(&cfg),
        baton_engine::profile::Freshness::decl(&cfg),
        baton_engine::profile::CategoryRow::decl(&cfg),
        baton_engine::profile::WorkerLearning::decl(&cfg),
        baton_engine::profile::ChatMarks::decl(&cfg),
        baton_engine::Route::decl(&cfg),
        baton_engine::profile::RouteHow::decl(&cfg),
        baton_engine::profile::KindRoute::decl(&cfg),
        baton_engine::profile::PoolLearning::decl(&cfg),
        baton_engine::profile::PlanVariety::decl(&cfg),
        crate::learn::LearnRequest::decl(&cfg),
        crate::learn::Learned::decl(&cfg),
        crate::local_api::LocalApiForm::decl(&cfg),
        crate::local_api::LocalApiStatus::decl(&cfg),
    ];
    let mut out = String::from(
        "// Generated from Baton's Rust types by `src-tauri/src/bindings.rs`; do not edit.\n\
         // Regenerate: UPDATE_BINDINGS=1 cargo test -p baton-desktop bindings\n\n\
         export type JsonValue = number | string | boolean | Array<JsonValue> | { [key in string]?: JsonValue } | null;\n",
    );
    for decl in decls {
        out.push_str("\nexport ");
        out.push_str(&decl);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn bindings_match_the_rust_types() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../ui/src/bindings.ts");
        let fresh = super::typescript();
        if std::env::var_os("UPDATE_BINDINGS").is_some() {
            std::fs::write(&path, &fresh).unwrap();
            return;
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == fresh,
            "ui/src/bindings.ts is stale: run `UPDATE_BINDINGS=1 cargo test -p baton-desktop bindings` and commit it"
        );
    }
}
