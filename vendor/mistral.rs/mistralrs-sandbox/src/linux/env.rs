pub(crate) use crate::env_scrub::apply;
