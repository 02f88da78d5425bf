//! A test-only fault hook for one-way link messages: `DUET_FAULT_LINK` duplicates, delays
//! (and so reorders) messages of chosen kinds, to prove the protocol above tolerates what a
//! network and retries produce. Off unless the variable is set; then read once.
//!
//! `DUET_FAULT_LINK="dup=0.1,delay=0.2,delay_ms=200,kinds=decode.;bootstrap."` duplicates
//! 10 % of matching messages, sends 20 % of them late (up to `delay_ms`, so later messages
//! overtake them), and touches only kinds starting with one of the `;`-separated prefixes.

use std::sync::OnceLock;
use std::time::Duration;

/// What to do with one message.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Fault {
    /// Send it as is.
    Pass,
    /// Send it twice.
    Duplicate,
    /// Send it after this long (later ones overtake it).
    Delay(Duration),
}

#[derive(Debug, Default)]
struct Plan {
    dup: f64,
    delay: f64,
    delay_ms: u64,
    kinds: Vec<String>,
}

fn parse(spec: &str) -> Plan {
    let mut plan = Plan {
        delay_ms: 100,
        ..Plan::default()
    };
    for part in spec.split(',') {
        let Some((k, v)) = part.split_once('=') else {
            continue;
        };
        match k.trim() {
            "dup" => plan.dup = v.parse().unwrap_or(0.0),
            "delay" => plan.delay = v.parse().unwrap_or(0.0),
            "delay_ms" => plan.delay_ms = v.parse().unwrap_or(100),
            "kinds" => plan.kinds = v.split(';').map(|s| s.trim().to_string()).collect(),
            _ => {}
        }
    }
    plan
}

fn plan() -> Option<&'static Plan> {
    static PLAN: OnceLock<Option<Plan>> = OnceLock::new();
    PLAN.get_or_init(|| std::env::var("DUET_FAULT_LINK").ok().map(|s| parse(&s)))
        .as_ref()
}

/// The fault for a one-way message of `kind`.
pub(crate) fn draw(kind: &str) -> Fault {
    let Some(p) = plan() else {
        return Fault::Pass;
    };
    decide(p, kind, rand::random::<f64>(), rand::random::<f64>())
}

fn decide(p: &Plan, kind: &str, a: f64, b: f64) -> Fault {
    if !p.kinds.iter().any(|k| kind.starts_with(k.as_str())) {
        return Fault::Pass;
    }
    if a < p.dup {
        Fault::Duplicate
    } else if a < p.dup + p.delay {
        Fault::Delay(Duration::from_millis((b * p.delay_ms as f64) as u64 + 1))
    } else {
        Fault::Pass
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_chosen_kinds_are_touched() {
        let p = parse("dup=0.5,delay=0.5,delay_ms=10,kinds=decode.;bootstrap.");
        assert_eq!(decide(&p, "router.events", 0.0, 0.0), Fault::Pass);
        assert_eq!(decide(&p, "decode.done", 0.1, 0.0), Fault::Duplicate);
        assert_eq!(
            decide(&p, "bootstrap.abort", 0.7, 0.5),
            Fault::Delay(Duration::from_millis(6))
        );
    }
}
