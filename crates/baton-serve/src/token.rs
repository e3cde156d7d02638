//! The bearer token clients send: one source for `baton serve` and the app's Local API, so the
//! token `baton serve token` prints is the one the app shows and both servers check.

use baton_secrets::{KeyStore, SecretsError};

/// The keychain entry that holds the server's token (`baton serve token`).
pub const TOKEN_ACCOUNT: &str = "baton-serve-token";

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error(
        "the token variable {0} (token_env) is not set, or is empty: set it, or leave token_env out to use the keychain's token (`baton serve token`)"
    )]
    VariableUnset(String),
    #[error("the token comes from the environment variable {0} (token_env): change the variable to change the token")]
    FromVariable(String),
    #[error("the operating system gave no random bytes for a token: {0}")]
    NoRandom(String),
    #[error(transparent)]
    Keychain(#[from] SecretsError),
}

/// A new token: 32 random bytes from the operating system, as 64 hex digits.
fn new_token() -> Result<String, TokenError> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| TokenError::NoRandom(e.to_string()))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// The token clients must send: the variable `token_env` names when there is one, else the
/// keychain's, made and stored the first time (or anew when `renew`: every client then needs the
/// new one).
pub fn token(token_env: Option<&str>, renew: bool) -> Result<String, TokenError> {
    if let Some(var) = token_env {
        if renew {
            return Err(TokenError::FromVariable(var.to_owned()));
        }
        return match std::env::var(var) {
            Ok(t) if !t.trim().is_empty() => Ok(t.trim().to_owned()),
            _ => Err(TokenError::VariableUnset(var.to_owned())),
        };
    }
    let keys = KeyStore::open()?;
    if !renew && let Some(token) = keys.get(TOKEN_ACCOUNT)? {
        return Ok(token.expose().to_owned());
    }
    let token = new_token()?;
    keys.set(TOKEN_ACCOUNT, &token)?;
    Ok(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_token_is_64_hex_digits_and_never_the_same() {
        let (a, b) = (new_token().unwrap(), new_token().unwrap());
        assert_eq!(a.len(), 64);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()), "{a}");
        assert_ne!(a, b);
    }

    #[test]
    fn a_variable_token_cannot_be_renewed_and_an_unset_one_is_named() {
        let var = "BATON_TEST_TOKEN_THAT_IS_NEVER_SET";
        let unset = token(Some(var), false).unwrap_err().to_string();
        assert!(unset.contains(var) && unset.contains("not set"), "{unset}");
        let renew = token(Some(var), true).unwrap_err().to_string();
        assert!(renew.contains(var) && renew.contains("change the variable"), "{renew}");
    }
}
