//! The ledger alone: caps, holds, and what a call that ends without its usage counts.

use super::*;

fn usage(input: u64, output: u64) -> Usage {
    Usage { input_tokens: input, output_tokens: output, ..Usage::default() }
}

fn worst(tokens: u64, cost: Option<f64>) -> WorstCase {
    WorstCase { input_tokens: tokens / 2, output_tokens: tokens - tokens / 2, cost_usd: cost }
}

#[test]
fn a_call_that_cannot_fit_is_refused_and_names_the_cap() {
    let ledger = Ledger::new(Budget { max_tokens: Some(100), ..Budget::default() });
    let r = ledger.try_reserve(Caller::Worker, "a", worst(60, Some(0.0)), &Pricing::Free).expect("fits");
    r.settle(usage(30, 20), Some(0.0));
    let refused =
        ledger.try_reserve(Caller::Worker, "b", worst(60, Some(0.0)), &Pricing::Free).expect_err("50 + 60 > 100");
    let refused = refused.expect("never fits");
    assert_eq!(refused.cap, Cap::Tokens);
    assert!(refused.message.contains("up to 60 tokens") && refused.message.contains("50 of at most 100"), "{refused}");
}

#[test]
fn calls_in_flight_hold_their_worst_case() {
    let ledger = Ledger::new(Budget { max_tokens: Some(100), ..Budget::default() });
    let first = ledger.try_reserve(Caller::Worker, "a", worst(60, Some(0.0)), &Pricing::Free).expect("fits");
    assert!(
        matches!(ledger.try_reserve(Caller::Worker, "b", worst(60, Some(0.0)), &Pricing::Free), Err(None)),
        "fits only once the first settles"
    );
    first.settle(usage(10, 10), Some(0.0));
    let second = ledger.try_reserve(Caller::Worker, "b", worst(60, Some(0.0)), &Pricing::Free).expect("fits now");
    drop(second);
    let spent = ledger.spent();
    assert_eq!(spent.workers.calls, 2, "a dropped reservation still counts its call");
    assert_eq!(spent.total().usage.total(), 20);
}

#[test]
fn callers_are_counted_apart_and_unknown_prices_named() {
    let ledger = Ledger::new(Budget::default());
    ledger
        .try_reserve(Caller::Conductor, "the conductor", worst(10, Some(0.0)), &Pricing::Free)
        .unwrap()
        .settle(usage(7, 3), Some(0.0));
    ledger.try_reserve(Caller::Worker, "w", worst(10, None), &Pricing::Unknown).unwrap().settle(usage(4, 2), None);
    let spent = ledger.spent();
    assert_eq!((spent.conductor.calls, spent.conductor.usage.total()), (1, 10));
    assert_eq!((spent.workers.calls, spent.workers.usage.total()), (1, 6));
    assert!(spent.conductor.cost_complete && !spent.workers.cost_complete);
    assert_eq!(spent.cost_unknown_for, vec!["w".to_owned()]);
    assert_eq!(spent.total().calls, 2);
}

#[test]
fn the_calls_cap_counts_calls_in_flight() {
    let ledger = Ledger::new(Budget { max_calls: Some(1), ..Budget::default() });
    let _held = ledger.try_reserve(Caller::Worker, "a", worst(1, Some(0.0)), &Pricing::Free).unwrap();
    let refused =
        ledger.try_reserve(Caller::Conductor, "c", worst(1, Some(0.0)), &Pricing::Free).expect_err("one call only");
    assert_eq!(refused.map(|e| e.cap), Some(Cap::Calls));
}

#[test]
fn worst_case_counts_bytes_and_framing() {
    let messages = [Message::user("héllo"), Message::assistant("ok"), Message::user("go")];
    let w = WorstCase::of(Some("sys"), &messages, 50, &Pricing::Free);
    assert_eq!(w.input_tokens, (3 + 6 + 2 + 2) + 5 * FRAMING_TOKENS);
    assert_eq!(w.output_tokens, 50);
    assert_eq!(w.cost_usd, Some(0.0));
}

#[test]
fn output_room_is_what_is_left_after_spent_held_and_input() {
    let ledger = Ledger::new(Budget { max_tokens: Some(100), ..Budget::default() });
    assert_eq!(Ledger::new(Budget::default()).output_room(10), None);
    let held = ledger.try_reserve(Caller::Worker, "a", worst(30, Some(0.0)), &Pricing::Free).unwrap();
    assert_eq!(ledger.output_room(20), Some(50));
    held.settle(usage(5, 5), Some(0.0));
    assert_eq!(ledger.output_room(20), Some(70));
    assert_eq!(ledger.output_room(500), Some(0));
}

#[test]
fn a_hold_keeps_its_room_from_other_calls_until_dropped() {
    let ledger = Ledger::new(Budget { max_tokens: Some(100), ..Budget::default() });
    let hold = ledger.hold("w", worst(60, Some(0.0))).expect("fits");
    assert_eq!(ledger.output_room(0), Some(40), "the held room is not offered");
    let refused = ledger
        .try_reserve(Caller::Conductor, "c", worst(50, Some(0.0)), &Pricing::Free)
        .expect_err("50 beside 60 held passes 100")
        .expect("and never fits while the hold lasts: waiting would not end");
    assert!(refused.message.contains("60 are held back"), "{refused}");
    ledger
        .try_reserve(Caller::Conductor, "c", worst(40, Some(0.0)), &Pricing::Free)
        .expect("fits beside it")
        .settle(usage(20, 20), Some(0.0));
    drop(hold);
    ledger
        .try_reserve(Caller::Worker, "w", worst(60, Some(0.0)), &Pricing::Free)
        .expect("the held call fits")
        .settle(usage(30, 30), Some(0.0));
    assert_eq!(ledger.spent().total().calls, 2, "a hold is no call");

    let ledger = Ledger::new(Budget { max_calls: Some(1), ..Budget::default() });
    let hold = ledger.hold("w", worst(1, Some(0.0))).expect("fits");
    let refused = ledger
        .try_reserve(Caller::Conductor, "c", worst(1, Some(0.0)), &Pricing::Free)
        .expect_err("the one call is held");
    assert_eq!(refused.map(|e| e.cap), Some(Cap::Calls));
    drop(hold);
    assert!(ledger.try_reserve(Caller::Worker, "w", worst(1, Some(0.0)), &Pricing::Free).is_ok());
    assert!(Ledger::new(Budget { max_tokens: Some(10), ..Budget::default() }).hold("w", worst(11, None)).is_err());
}

#[test]
fn a_call_that_ends_without_its_usage_counts_what_it_sent_and_received() {
    // $1 a token in, $2 out.
    let price = Pricing::Pool(crate::prices::Price { input: 1e6, output: 2e6, cached_input: None });
    let conductor = |ledger: &Ledger| ledger.spent().conductor;

    // A local prompt (its count exact) stopped after 12 bytes of plan: dropped unsettled.
    let ledger = Ledger::new(Budget::default());
    let r = ledger.try_reserve(Caller::Conductor, "c", WorstCase::of_size(300, 1000, &price), &price).unwrap();
    r.sent(true);
    r.received(12);
    drop(r);
    let c = conductor(&ledger);
    assert_eq!((c.calls, c.usage.input_tokens, c.usage.output_tokens, c.usage.estimated), (1, 300, 12, true));
    assert_eq!(c.cost_usd, 300.0 + 24.0);

    // The same prompt failing before any text: its input, exactly, and nothing estimated.
    let ledger = Ledger::new(Budget::default());
    let r = ledger.try_reserve(Caller::Conductor, "c", WorstCase::of_size(300, 1000, &price), &price).unwrap();
    r.sent(true);
    assert_eq!(r.settle_cut(None).0, Usage { input_tokens: 300, ..Usage::default() });

    // A stream that reported its input as it opened (Anthropic) and was cut after 40 bytes:
    // the input as reported, not the request's bound; the output from the bytes.
    let ledger = Ledger::new(Budget::default());
    let r = ledger.try_reserve(Caller::Conductor, "c", WorstCase::of_size(300, 1000, &price), &price).unwrap();
    *r.reported().lock().unwrap() = usage(120, 0);
    r.received(40);
    let (u, cost) = r.settle_cut(None);
    assert_eq!((u.input_tokens, u.output_tokens, u.estimated), (120, 40, true));
    assert_eq!(cost, Some(120.0 + 80.0));

    // A request that never went out and got nothing back counts nothing but the call.
    let ledger = Ledger::new(Budget::default());
    drop(ledger.try_reserve(Caller::Conductor, "c", WorstCase::of_size(300, 1000, &price), &price).unwrap());
    assert_eq!((conductor(&ledger).calls, conductor(&ledger).usage.total()), (1, 0));
}

#[tokio::test]
async fn a_waiting_call_proceeds_when_room_is_freed() {
    let ledger = std::sync::Arc::new(Ledger::new(Budget { max_tokens: Some(100), ..Budget::default() }));
    let stop = CancellationToken::new();
    let first = ledger.try_reserve(Caller::Worker, "a", worst(80, Some(0.0)), &Pricing::Free).unwrap();
    let waiter = {
        let ledger = ledger.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let r = ledger.reserve(Caller::Worker, "b", worst(50, Some(0.0)), &Pricing::Free, &stop).await;
            r.map(|r| r.settle(usage(1, 1), Some(0.0))).is_ok()
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    assert!(!waiter.is_finished(), "waits while the first call holds 80");
    first.settle(usage(20, 20), Some(0.0));
    assert!(waiter.await.unwrap());
    assert_eq!(ledger.spent().total().usage.total(), 42);
}
