//! Keys through the real Secret Service (gnome-keyring on a private D-Bus session, started by
//! scripts/test), checked from outside with `secret-tool`, the reference Secret Service client.
//!
//! These tests write and delete entries, so they refuse to run against a keyring that may be the
//! user's own: scripts/test marks its throwaway session with `BATON_TEST_KEYRING=private`.

use std::process::Command;

use baton_providers::ProviderKind;
use baton_secrets::{KeyStatus, KeyStore, SERVICE, SecretsError, account};

/// The store, or `None` when the user chose to skip these tests; anything else that keeps them
/// from running is a failure, so that a missing keychain cannot pass for a working one.
fn keychain() -> Option<KeyStore> {
    baton_tests::private_keychain()
        .then(|| KeyStore::open().unwrap_or_else(|e| panic!("the keychain should be usable here: {e}")))
}

/// What `secret-tool` finds under the attributes keyring's Secret Service store writes.
fn secret_tool_lookup(account: &str) -> Option<String> {
    let out = Command::new("secret-tool")
        .args(["lookup", "service", SERVICE, "username", account])
        .output()
        .expect("secret-tool runs (scripts/setup installs libsecret-tools)");
    // secret-tool exits 1 with no output when nothing matches.
    out.status.success().then(|| String::from_utf8(out.stdout).expect("UTF-8 secret"))
}

/// Every attribute of the items stored for `account`, as `secret-tool search` prints them.
fn secret_tool_attributes(account: &str) -> Vec<String> {
    let out = Command::new("secret-tool")
        .args(["search", "--all", "service", SERVICE, "username", account])
        .output()
        .expect("secret-tool runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let mut attributes: Vec<String> = text.lines().filter(|l| l.starts_with("attribute.")).map(str::to_owned).collect();
    attributes.sort();
    attributes
}

fn status(store: &KeyStore, account: &str) -> KeyStatus {
    store.list(&[account.to_owned()]).expect("list").pop().expect("one status")
}

#[test]
fn a_key_round_trips_through_the_secret_service() {
    let Some(store) = keychain() else { return };
    let account = account(ProviderKind::Gemini, None);
    let key = "gm-roundtrip-0123456789-wxyz";
    store.delete(&account).expect("clean slate");

    store.set(&account, key).expect("set");
    assert_eq!(store.get(&account).expect("get").expect("stored").expose(), key);
    assert_eq!(secret_tool_lookup(&account).as_deref(), Some(key), "really in the Secret Service");
    assert_eq!(
        secret_tool_attributes(&account),
        ["attribute.service = baton", "attribute.username = gemini"],
        "one item, filed under the service and the account"
    );
    assert_eq!(
        status(&store, &account),
        KeyStatus { account: account.clone(), stored: true, last4: Some("wxyz".into()) }
    );

    // Setting again replaces the key in the same item rather than adding a second one.
    store.set(&account, "gm-replaced-0123456789-abcd").expect("replace");
    assert_eq!(secret_tool_lookup(&account).as_deref(), Some("gm-replaced-0123456789-abcd"));
    assert_eq!(secret_tool_attributes(&account).len(), 2, "still one item");

    assert!(store.delete(&account).expect("delete"), "there was a key");
    assert_eq!(store.get(&account).expect("get after delete"), None);
    assert_eq!(secret_tool_lookup(&account), None, "gone from the Secret Service");
    assert!(!store.delete(&account).expect("second delete"), "nothing left to delete");
    assert_eq!(status(&store, &account), KeyStatus { account, stored: false, last4: None });
}

#[test]
fn listings_show_the_last_four_characters_of_long_keys_only() {
    let Some(store) = keychain() else { return };
    let short = account(ProviderKind::Anthropic, None);
    let long = account(ProviderKind::OpenAiCompatible, Some("http://127.0.0.1:9/listing/v1"));
    store.set(&short, "sk-short").expect("set short");
    store.set(&long, "sk-long-enough-1234").expect("set long");

    let statuses = store.list(&[short.clone(), long.clone()]).expect("list");
    assert_eq!(
        statuses,
        [
            KeyStatus { account: short.clone(), stored: true, last4: None },
            KeyStatus { account: long.clone(), stored: true, last4: Some("1234".into()) },
        ]
    );
    let shown = format!("{statuses:?}");
    assert!(!shown.contains("sk-short") && !shown.contains("sk-long-enough"), "{shown}");
    // The key type redacts itself too.
    assert_eq!(format!("{:?}", store.get(&long).expect("get")), "Some(ApiKey(<redacted>))");

    assert!(store.delete(&short).expect("delete short"));
    assert!(store.delete(&long).expect("delete long"));
}

#[test]
fn each_openai_compatible_server_has_its_own_entry() {
    let Some(store) = keychain() else { return };
    let a = account(ProviderKind::OpenAiCompatible, Some("http://127.0.0.1:8001/v1/"));
    let b = account(ProviderKind::OpenAiCompatible, Some("http://127.0.0.1:8002/v1"));
    assert_eq!(a, "openai-compatible:http://127.0.0.1:8001/v1", "trailing slash trimmed");
    store.set(&a, "key-for-server-a-0001").expect("set a");
    store.set(&b, "key-for-server-b-0002").expect("set b");

    assert_eq!(secret_tool_lookup(&a).as_deref(), Some("key-for-server-a-0001"));
    assert_eq!(secret_tool_lookup(&b).as_deref(), Some("key-for-server-b-0002"));
    let same_as_a = account(ProviderKind::OpenAiCompatible, Some("http://127.0.0.1:8001/v1"));
    assert_eq!(store.get(&same_as_a).expect("get").expect("stored").expose(), "key-for-server-a-0001");

    assert!(store.delete(&a).expect("delete a"));
    assert_eq!(store.get(&a).expect("get a"), None);
    assert_eq!(store.get(&b).expect("get b").expect("b untouched").expose(), "key-for-server-b-0002");
    assert!(store.delete(&b).expect("delete b"));
}

#[test]
fn an_empty_key_is_refused_and_nothing_is_stored() {
    let Some(store) = keychain() else { return };
    let account = account(ProviderKind::OpenAiCompatible, Some("http://127.0.0.1:9/empty/v1"));
    assert!(matches!(store.set(&account, ""), Err(SecretsError::EmptyKey)));
    assert_eq!(store.get(&account).expect("get"), None);
    assert_eq!(secret_tool_lookup(&account), None);
}
