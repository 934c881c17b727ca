//! How the host's bandwidth budget is divided among the running outbound
//! migrations: a pure function of their figures, recomputed at every tick
//! of the agent (docs/fleet.md, "The division").
//!
//! Two divisions:
//!
//! * [`Division::ConvergeFirst`] (the default). A migration that is sent
//!   less than its guest dirties never converges: the bytes it is given are
//!   spent re-sending pages, and it holds its slot (and its guest's
//!   throttle) the longer. So each running migration first gets its
//!   *floor*: its dirty rate plus a quarter, plus a keep-alive. When the
//!   floors do not all fit, the migrations at the back of the order are
//!   *held* at the keep-alive (auto-converge off, so their guests are not
//!   throttled for a wait the agent chose) instead of all of them losing
//!   ground together. What is left after the floors goes to the front of
//!   the order. The order: switching over first (the guest is paused),
//!   then priority, then Smith's rule for weighted shortest processing
//!   time, with the processing time the time to finish alone at the full
//!   budget (`remaining / (budget - dirty rate)`) and the weight the dirty
//!   rate (what every second of delay costs in bytes sent again) plus a
//!   sixteenth of the budget (so an idle guest still counts). A guest that
//!   cannot converge at the whole budget comes last: it waits until it has
//!   the link to itself, where it is no worse off than migrating alone.
//! * [`Division::Equal`]: the budget split evenly, a capped migration's
//!   unused part shared by the others; for comparison.
//!
//! Work-conserving: a migration that for two seconds used less than four
//! fifths of its share is limited to one and a half times what it used,
//! and the rest flows on down the order.

use serde::{Deserialize, Serialize};

/// How the budget is divided.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Division {
    /// Floors against the dirty rate, then the rest to the migration that
    /// finishes soonest for what its delay costs (see the module docs).
    #[default]
    ConvergeFirst,
    /// Equal shares.
    Equal,
}

/// One running migration's figures, as the division reads them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Load {
    /// Higher first.
    pub priority: i32,
    /// Dirty bytes still to send (the guest's memory before the first
    /// sync).
    pub remaining: u64,
    /// Bytes per second the guest dirties (0 before the first sync).
    pub dirty_rate: u64,
    /// Bytes per second it moved over the latest window, as far as the
    /// agent believes it.
    pub transfer_rate: u64,
    /// The share it had, bytes per second (0: none yet).
    pub previous_share: u64,
    /// Whether that share has not been raised for two seconds, so that
    /// the transfer rate had time to follow it.
    pub share_steady: bool,
    /// The operator's cap for it (`bandwidthPerMigration`).
    pub cap: Option<u64>,
    /// Paused on the source, sending the last pages.
    pub switching_over: bool,
}

/// One migration's part of the budget.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Share {
    /// Bytes per second; 0 means uncapped (no budget).
    pub bandwidth: u64,
    /// Held at the keep-alive share: its floor did not fit.
    pub held: bool,
}

/// The keep-alive: what every running migration gets at least, so that
/// its connections and its progress reports stay alive.
pub fn keep_alive(budget: u64, running: usize) -> u64 {
    let running = running.max(1) as u64;
    (budget / 64).max(1 << 20).min(budget / running)
}

/// The floor: what a migration needs to make progress against its dirty
/// rate.
pub fn floor(load: &Load, keep: u64) -> u64 {
    load.dirty_rate
        .saturating_add(load.dirty_rate / 4)
        .saturating_add(keep)
}

/// Divides `budget` (bytes per second, 0 for none) among `loads`; the
/// shares in the same order. The shares never add up to more than the
/// budget.
pub fn divide(budget: u64, loads: &[Load], division: Division) -> Vec<Share> {
    if budget == 0 {
        return vec![Share::default(); loads.len()];
    }
    match division {
        Division::Equal => divide_equally(budget, loads),
        Division::ConvergeFirst => divide_converge_first(budget, loads),
    }
}

/// The most a migration can use: its cap, and when it did not use its
/// share, one and a half times what it used (but never below its floor).
fn limit(load: &Load, keep: u64) -> u64 {
    let cap = load.cap.filter(|&cap| cap > 0).unwrap_or(u64::MAX);
    let underused = load.share_steady
        && load.previous_share > 0
        && load.transfer_rate.saturating_mul(5) < load.previous_share.saturating_mul(4);
    let demand = if underused {
        (load.transfer_rate.saturating_mul(3) / 2).max(floor(load, keep))
    } else {
        u64::MAX
    };
    cap.min(demand)
}

fn divide_equally(budget: u64, loads: &[Load]) -> Vec<Share> {
    let mut shares = vec![Share::default(); loads.len()];
    let mut open: Vec<usize> = (0..loads.len()).collect();
    let mut left = budget;
    // Water-filling: the capped take their cap, the rest split what is left.
    while !open.is_empty() && left > 0 {
        let each = left / open.len() as u64;
        let (capped, uncapped): (Vec<usize>, Vec<usize>) = open.iter().partition(|&&index| {
            loads[index]
                .cap
                .is_some_and(|cap| cap > 0 && cap - shares[index].bandwidth <= each)
        });
        if capped.is_empty() {
            for &index in &uncapped {
                shares[index].bandwidth += each;
            }
            break;
        }
        for &index in &capped {
            let room = loads[index].cap.unwrap_or(0) - shares[index].bandwidth;
            shares[index].bandwidth += room;
            left -= room;
        }
        open = uncapped;
    }
    shares
}

/// The order of [`Division::ConvergeFirst`]: indices, first served first.
pub fn converge_first_order(budget: u64, loads: &[Load]) -> Vec<usize> {
    let key = |load: &Load| -> f64 {
        let spare = budget.saturating_sub(load.dirty_rate);
        if spare == 0 {
            return f64::INFINITY;
        }
        let finish_alone = load.remaining as f64 / spare as f64;
        let weight = load.dirty_rate as f64 + budget as f64 / 16.0;
        finish_alone / weight
    };
    let mut order: Vec<usize> = (0..loads.len()).collect();
    order.sort_by(|&a, &b| {
        let (left, right) = (&loads[a], &loads[b]);
        right
            .switching_over
            .cmp(&left.switching_over)
            .then(right.priority.cmp(&left.priority))
            .then(key(left).total_cmp(&key(right)))
            .then(a.cmp(&b))
    });
    order
}

fn divide_converge_first(budget: u64, loads: &[Load]) -> Vec<Share> {
    let keep = keep_alive(budget, loads.len());
    let mut shares = vec![
        Share {
            bandwidth: keep,
            held: true,
        };
        loads.len()
    ];
    let mut left = budget - keep * loads.len() as u64;
    let order = converge_first_order(budget, loads);
    // Floors, in order; the first always runs, whatever it needs.
    for (rank, &index) in order.iter().enumerate() {
        let want = floor(&loads[index], keep)
            .min(limit(&loads[index], keep))
            .saturating_sub(keep);
        if want <= left {
            shares[index].bandwidth += want;
            left -= want;
            shares[index].held = false;
        } else if rank == 0 {
            shares[index].bandwidth += left;
            left = 0;
            shares[index].held = false;
        }
    }
    // The rest down the order: those running first, then the held ones
    // (they take what nobody ahead can use).
    for held in [false, true] {
        let group: Vec<usize> = order
            .iter()
            .copied()
            .filter(|&index| shares[index].held == held)
            .collect();
        for index in group {
            let room = limit(&loads[index], keep).saturating_sub(shares[index].bandwidth);
            let give = room.min(left);
            shares[index].bandwidth += give;
            left -= give;
            if shares[index].bandwidth >= floor(&loads[index], keep) {
                shares[index].held = false;
            }
        }
    }
    // A cap below the keep-alive is still a cap.
    for (share, load) in shares.iter_mut().zip(loads) {
        if let Some(cap) = load.cap.filter(|&cap| cap > 0) {
            share.bandwidth = share.bandwidth.min(cap);
        }
    }
    shares
}

#[cfg(test)]
mod tests {
    use super::{Division, Load, Share, divide, floor, keep_alive};

    const MB: u64 = 1_000_000;
    const BUDGET: u64 = 125 * MB;

    fn load(remaining: u64, dirty_rate: u64) -> Load {
        Load {
            remaining,
            dirty_rate,
            ..Load::default()
        }
    }

    fn total(shares: &[Share]) -> u64 {
        shares.iter().map(|share| share.bandwidth).sum()
    }

    #[test]
    fn no_budget_leaves_everyone_uncapped() {
        let shares = divide(0, &[load(1, 1), load(2, 2)], Division::ConvergeFirst);
        assert_eq!(shares, vec![Share::default(); 2]);
        assert!(divide(BUDGET, &[], Division::Equal).is_empty());
    }

    #[test]
    fn equal_shares_give_a_capped_migrations_rest_to_the_others() {
        let mut capped = load(1, 0);
        capped.cap = Some(5 * MB);
        let shares = divide(120 * MB, &[load(1, 0), capped, load(1, 0)], Division::Equal);
        let bandwidths: Vec<u64> = shares.iter().map(|share| share.bandwidth).collect();
        assert_eq!(bandwidths, vec![57_500_000, 5 * MB, 57_500_000]);
    }

    #[test]
    fn the_dirtier_goes_before_the_idle_guest() {
        let idle = load(1 << 30, 0);
        let dirtier = load(1 << 30, 30 * MB);
        let shares = divide(BUDGET, &[idle, dirtier], Division::ConvergeFirst);
        let keep = keep_alive(BUDGET, 2);
        assert_eq!(
            shares[0].bandwidth, keep,
            "the idle guest waits at keep-alive"
        );
        assert_eq!(shares[1].bandwidth, BUDGET - keep);
        assert!(!shares[0].held && !shares[1].held);
    }

    #[test]
    fn a_guest_that_cannot_converge_waits_for_the_link_to_itself() {
        let hopeless = load(1 << 30, 150 * MB);
        let moderate = load(1 << 30, 40 * MB);
        let shares = divide(
            BUDGET,
            &[hopeless.clone(), moderate.clone(), moderate],
            Division::ConvergeFirst,
        );
        assert!(shares[0].held, "{shares:?}");
        assert_eq!(shares[0].bandwidth, keep_alive(BUDGET, 3));
        for share in &shares[1..] {
            assert!(!share.held);
        }
        // Alone, it has everything (and converges by its own throttle, as
        // it would alone).
        let alone = divide(BUDGET, &[hopeless], Division::ConvergeFirst);
        assert_eq!(alone[0].bandwidth, BUDGET);
        assert!(!alone[0].held);
    }

    #[test]
    fn running_migrations_never_get_less_than_their_floor() {
        // A deterministic spread of loads (a linear congruential sequence).
        let mut seed = 7_u64;
        let mut next = |bound: u64| {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            (seed >> 33) % bound
        };
        for _ in 0..500 {
            let count = 1 + usize::try_from(next(6)).expect("below 6");
            let loads: Vec<Load> = (0..count)
                .map(|_| Load {
                    priority: i32::try_from(next(3)).expect("below 3"),
                    remaining: next(1 << 30),
                    dirty_rate: next(160 * MB),
                    transfer_rate: next(130 * MB),
                    previous_share: next(130 * MB),
                    share_steady: next(2) == 0,
                    cap: (next(4) == 0).then(|| next(130 * MB)),
                    switching_over: next(10) == 0,
                })
                .collect();
            for division in [Division::ConvergeFirst, Division::Equal] {
                let shares = divide(BUDGET, &loads, division);
                assert!(total(&shares) <= BUDGET, "{loads:?} {shares:?}");
                if division == Division::Equal {
                    continue;
                }
                let keep = keep_alive(BUDGET, count);
                let running = shares.iter().filter(|share| !share.held).count();
                assert!(running >= 1, "someone always runs: {loads:?}");
                for (load, share) in loads.iter().zip(&shares) {
                    let cap = load.cap.filter(|&cap| cap > 0).unwrap_or(u64::MAX);
                    assert!(share.bandwidth >= keep.min(cap));
                    assert!(share.bandwidth <= cap);
                    let capped = load
                        .cap
                        .is_some_and(|cap| cap > 0 && share.bandwidth >= cap);
                    if !share.held && share.bandwidth < floor(load, keep) && !capped {
                        // Only the first in order may run below its floor:
                        // when it took all that was left (but what caps
                        // below the keep-alive gave back).
                        let given_back: u64 = loads
                            .iter()
                            .filter_map(|load| load.cap.filter(|&cap| cap > 0))
                            .map(|cap| keep.saturating_sub(cap))
                            .sum();
                        assert!(
                            total(&shares) + given_back >= BUDGET,
                            "{loads:?} {shares:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn an_underused_share_flows_down_the_order() {
        let mut slow = load(1 << 30, 20 * MB);
        slow.previous_share = 100 * MB;
        slow.transfer_rate = 40 * MB;
        slow.share_steady = true;
        let idle = load(1 << 30, 0);
        let shares = divide(
            BUDGET,
            &[slow.clone(), idle.clone()],
            Division::ConvergeFirst,
        );
        assert_eq!(shares[0].bandwidth, 60 * MB);
        assert_eq!(shares[1].bandwidth, BUDGET - 60 * MB);
        // Not yet steady: it keeps the lot while its rate catches up.
        slow.share_steady = false;
        let shares = divide(BUDGET, &[slow, idle], Division::ConvergeFirst);
        assert_eq!(shares[0].bandwidth, BUDGET - keep_alive(BUDGET, 2));
    }

    #[test]
    fn switching_over_and_priority_come_first() {
        let mut urgent = load(1 << 30, 60 * MB);
        urgent.priority = 1;
        let mut pausing = load(1 << 20, 60 * MB);
        pausing.switching_over = true;
        let plain = load(1 << 20, 60 * MB);
        let order = super::converge_first_order(BUDGET, &[plain, urgent, pausing]);
        assert_eq!(order, vec![2, 1, 0]);
    }
}
