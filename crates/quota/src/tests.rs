use super::*;
use good_lp::{constraint, variable, Expression, ProblemVariables, Solution, SolverModel};
use proptest::prelude::*;

fn cost() -> CostModel {
    CostModel {
        act_row_bytes: 6,
        grad_row_bytes: 4,
        expert_weight_bytes: 100,
        expert_grad_bytes: 100,
        flops_per_pair: 1e3,
        forward_flops_per_pair: 0.0,
        exchange_row_bytes: 0,
        link_bytes_per_s: 1e9,
        flops_per_s: 1e12,
    }
}

#[derive(Debug, Clone)]
struct Case {
    counts: Vec<Vec<u64>>,
    placement: Placement,
    budgets: Vec<RankBudget>,
}

fn case_strategy() -> impl Strategy<Value = Case> {
    sized_case_strategy((1, 5), (1, 7), 30, (3000, 2000))
}

/// Ranks and experts in the half-open ranges, counts below `most`, extra
/// memory and network bytes per rank below `bytes`.
fn sized_case_strategy(
    ranks: (usize, usize),
    experts: (usize, usize),
    most: u64,
    bytes: (u64, u64),
) -> impl Strategy<Value = Case> {
    (ranks.0..ranks.1, experts.0..experts.1).prop_flat_map(move |(n_ranks, n_experts)| {
        (
            prop::collection::vec(prop::collection::vec(0u64..most, n_experts), n_ranks),
            prop::collection::vec(0..n_ranks, n_experts),
            prop::collection::vec(prop::collection::vec(0..n_ranks, 0..2), n_experts),
            prop::collection::vec((0u64..bytes.0, 0u64..bytes.1), n_ranks),
        )
            .prop_map(move |(counts, owner, reps, budgets)| {
                let replicas = reps
                    .into_iter()
                    .enumerate()
                    .map(|(e, r)| {
                        let mut v: Vec<usize> = r.into_iter().filter(|&x| x != owner[e]).collect();
                        v.dedup();
                        v
                    })
                    .collect();
                let placement = Placement { owner, replicas };
                // Budgets always hold the experts themselves.
                let inst = placement.instances_per_rank(n_ranks);
                let budgets = budgets
                    .into_iter()
                    .enumerate()
                    .map(|(r, (m, n))| RankBudget {
                        memory_bytes: inst[r] * cost().instance_bytes() + m,
                        network_bytes: n,
                    })
                    .collect();
                Case {
                    counts,
                    placement,
                    budgets,
                }
            })
    })
}

fn inputs<'a>(c: &'a Case, cost: &'a CostModel) -> Inputs<'a> {
    Inputs {
        counts: &c.counts,
        placement: &c.placement,
        cost,
        budgets: &c.budgets,
    }
}

/// Plans, redistributes with the plan's caps, and checks every budget on the
/// resulting assignment (not only the model's bounds).
fn check(c: &Case, policy: Policy) -> Plan {
    let cost = cost();
    let plan = quotas(&inputs(c, &cost), policy).expect("budgets hold the experts");
    let k = plan.quotas.per_source();
    for (s, row) in k.iter().enumerate() {
        for (e, &q) in row.iter().enumerate() {
            assert!(
                q <= c.counts[s][e],
                "quota above routed count at ({s}, {e})"
            );
            assert!(
                q >= floor_ratio(
                    c.counts[s][e],
                    (plan.retention_floor * RATIO_DEN as f64) as u64
                ),
                "cell ({s}, {e}) below the retention floor"
            );
        }
    }
    let problem = redistribute::Problem {
        n_ranks: c.budgets.len(),
        kept: k.to_vec(),
        instances: plan.placement.all_instances(),
        base_load: vec![0; c.budgets.len()],
        rank_capacity: Some(plan.ranks.iter().map(|r| r.pair_capacity).collect()),
    };
    let a = redistribute::solve(&problem, &redistribute::Config::default())
        .expect("quotas are placeable within the caps");
    let row = cost.row_bytes();
    let stat = plan.placement.instances_per_rank(c.budgets.len());
    for (r, b) in c.budgets.iter().enumerate() {
        let m = &plan.ranks[r];
        assert!(
            m.memory_bytes <= b.memory_bytes,
            "rank {r}: modelled memory over budget"
        );
        assert!(
            m.dispatch_in_bytes <= b.network_bytes,
            "rank {r}: modelled network in over budget"
        );
        assert!(
            m.dispatch_out_bytes <= b.network_bytes,
            "rank {r}: modelled network out over budget"
        );
        let used = stat[r] * cost.instance_bytes() + a.pairs_per_rank[r] * row;
        assert!(
            used <= b.memory_bytes,
            "rank {r}: assigned memory over budget"
        );
        let received: u64 = a
            .routes
            .iter()
            .filter(|x| x.rank == r && x.source != r)
            .map(|x| x.pairs)
            .sum();
        let sent: u64 = a
            .routes
            .iter()
            .filter(|x| x.source == r && x.rank != r)
            .map(|x| x.pairs)
            .sum();
        assert!(received * row <= b.network_bytes && sent * row <= b.network_bytes);
    }
    plan
}

fn grow(c: &Case, extra_mem: &[u64], extra_net: &[u64]) -> Case {
    let mut bigger = c.clone();
    for (r, b) in bigger.budgets.iter_mut().enumerate() {
        b.memory_bytes += extra_mem[r];
        b.network_bytes += extra_net[r];
    }
    bigger
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn quotas_respect_counts_and_every_budget(c in case_strategy()) {
        check(&c, Policy::Uniform);
        check(&c, Policy::Maxmin);
    }

    #[test]
    fn memory_only_budgets_take_the_per_expert_network_and_keep_every_promise(c in case_strategy()) {
        let mut c = c;
        c.budgets.iter_mut().for_each(|b| b.network_bytes = u64::MAX);
        let u = check(&c, Policy::Uniform);
        let m = check(&c, Policy::Maxmin);
        prop_assert!(m.quotas.total() >= u.quotas.total());
        prop_assert_eq!(u.retention_floor, m.retention_floor);
    }

    #[test]
    fn gale_check_finds_the_same_ratio_as_the_max_flow_search(c in case_strategy()) {
        let mut c = c;
        c.budgets.iter_mut().for_each(|b| b.network_bytes = u64::MAX);
        let cost = cost();
        let inputs = inputs(&c, &cost);
        let (caps, send) = capacities(&inputs, &c.placement).unwrap();
        let hall = HallCheck::new(&inputs, &c.placement, &caps, &send).expect("few ranks, unlimited sends");
        let mut net = build_network(&inputs, &c.placement, &caps, &send);
        prop_assert_eq!(hall.largest_feasible(&inputs), flow_search(&mut net, (0, RATIO_DEN)));
    }

    #[test]
    fn counts_past_32_bits_search_alike(c in case_strategy(), shift in 30u32..40, with_sends in any::<bool>()) {
        // Counts and budgets scaled past 32 bits take the floors' wide
        // path; Gale's check and the cut-guided search must still agree,
        // and (with sends limited) the bracketed search the plain one.
        let mut c = c;
        c.counts.iter_mut().flatten().for_each(|n| *n = (*n << shift) + *n);
        c.budgets.iter_mut().for_each(|b| {
            b.memory_bytes = b.memory_bytes.saturating_mul(1 << shift);
            b.network_bytes = if with_sends { b.network_bytes.saturating_mul(1 << shift) } else { u64::MAX };
        });
        let cost = cost();
        let inputs = inputs(&c, &cost);
        let Ok((caps, send)) = capacities(&inputs, &c.placement) else { return Ok(()) };
        let mut net = build_network(&inputs, &c.placement, &caps, &send);
        prop_assert_eq!(net.terms.narrow.is_none(), c.counts.iter().flatten().any(|&n| n > u64::from(u32::MAX)));
        let plain = flow_search(&mut net, (0, RATIO_DEN));
        match HallCheck::new(&inputs, &c.placement, &caps, &send) {
            Some(hall) => prop_assert_eq!(hall.largest_feasible(&inputs), plain),
            None => {
                let mut net = build_network(&inputs, &c.placement, &caps, &send);
                let bracket = ratio_bracket(&inputs, &c.placement, &caps, &send);
                prop_assert_eq!(flow_search(&mut net, bracket), plain);
            }
        }
    }

    #[test]
    fn past_gale_s_ranks_the_cut_guided_search_finds_the_bisection_s_ratio(
        c in sized_case_strategy((13, 25), (8, 48), 200, (60_000, 40_000)),
        with_sends in any::<bool>(),
    ) {
        // Beyond 12 ranks only the flow search runs; a plain bisection with
        // a fresh flow for every ratio is the reference.
        let mut c = c;
        if !with_sends {
            c.budgets.iter_mut().for_each(|b| b.network_bytes = u64::MAX);
        }
        let cost = cost();
        let inputs = inputs(&c, &cost);
        let (caps, send) = capacities(&inputs, &c.placement).unwrap();
        let mut net = build_network(&inputs, &c.placement, &caps, &send);
        let reference = if uniform_flow(&mut net, RATIO_DEN).is_some() {
            RATIO_DEN
        } else {
            let (mut lo, mut hi) = (0, RATIO_DEN);
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                if uniform_flow(&mut net, mid).is_some() { lo = mid } else { hi = mid }
            }
            lo
        };
        let bracket = ratio_bracket(&inputs, &c.placement, &caps, &send);
        let mut net = build_network(&inputs, &c.placement, &caps, &send);
        prop_assert_eq!(flow_search(&mut net, bracket), reference);
        let mut net = build_network(&inputs, &c.placement, &caps, &send);
        prop_assert_eq!(flow_search(&mut net, (0, RATIO_DEN)), reference);
        // And the whole plan keeps every promise on a real assignment.
        let m = check(&c, Policy::Maxmin);
        prop_assert_eq!(m.retention_floor, reference as f64 / RATIO_DEN as f64);
    }

    #[test]
    fn the_narrow_floors_equal_the_wide_ones(counts in prop::collection::vec(any::<u32>(), 0..64), x in 0..=RATIO_DEN) {
        let wide: u64 = counts.iter().map(|&n| floor_ratio(u64::from(n), x)).sum();
        prop_assert_eq!(floor_sum_u32(&counts, x), wide);
    }

    #[test]
    fn the_bracket_holds_and_the_bracketed_search_finds_the_same_ratio(c in case_strategy()) {
        let cost = cost();
        let inputs = inputs(&c, &cost);
        let (caps, send) = capacities(&inputs, &c.placement).unwrap();
        let (lo, hi) = ratio_bracket(&inputs, &c.placement, &caps, &send);
        let mut net = build_network(&inputs, &c.placement, &caps, &send);
        let plain = flow_search(&mut net, (0, RATIO_DEN));
        prop_assert!(lo < hi);
        if plain < RATIO_DEN {
            prop_assert!(lo <= plain && plain < hi, "bracket [{}, {}) misses {}", lo, hi, plain);
        }
        let mut net = build_network(&inputs, &c.placement, &caps, &send);
        prop_assert_eq!(flow_search(&mut net, (lo, hi)), plain);
    }

    #[test]
    fn maxmin_keeps_at_least_uniform(c in case_strategy()) {
        let u = check(&c, Policy::Uniform);
        let m = check(&c, Policy::Maxmin);
        prop_assert_eq!(u.retention_floor, m.retention_floor);
        prop_assert!(m.quotas.total() >= u.quotas.total());
    }

    /// Where Gale's check finds every pair fits (few ranks, unlimited
    /// sends), `quotas` skips the flow network: the quotas it gives are the
    /// network's, under either policy, and every other case takes the
    /// network as before.
    #[test]
    fn the_full_retention_shortcut_gives_the_network_s_quotas(
        c in case_strategy(),
        policy in prop_oneof![Just(Policy::Uniform), Just(Policy::Maxmin)],
        roomy in any::<bool>(),
    ) {
        let mut c = c;
        for b in &mut c.budgets {
            b.network_bytes = u64::MAX;
            if roomy {
                // Room for every pair on every rank: the shortcut's case.
                b.memory_bytes = b.memory_bytes.saturating_add(1 << 40);
            }
        }
        let cost = cost();
        let inputs = inputs(&c, &cost);
        let plan = check(&c, policy);
        let (caps, send) = capacities(&inputs, &c.placement).unwrap();
        let hall = HallCheck::new(&inputs, &c.placement, &caps, &send).expect("few ranks, unlimited sends");
        let num = hall.largest_feasible(&inputs);
        let (net_num, net_quotas) = searched_quotas(&inputs, &c.placement, (&caps, &send), Some(num), policy);
        prop_assert_eq!(net_num, num);
        prop_assert_eq!(plan.quotas.per_source(), net_quotas.as_slice());
        prop_assert_eq!(plan.retention_floor, num as f64 / RATIO_DEN as f64);
        if roomy {
            prop_assert_eq!(num, RATIO_DEN);
        }
    }

    #[test]
    fn unlimited_budgets_keep_every_pair(c in case_strategy(), policy in prop_oneof![Just(Policy::Uniform), Just(Policy::Maxmin)]) {
        let mut c = c;
        c.budgets.iter_mut().for_each(|b| *b = RankBudget::UNLIMITED);
        let plan = check(&c, policy);
        prop_assert_eq!(plan.quotas.per_source(), c.counts.as_slice());
        prop_assert_eq!(plan.retention_floor, 1.0);
    }

    #[test]
    fn a_larger_budget_never_lowers_a_quota(
        c in case_strategy(),
        extra_mem in prop::collection::vec(0u64..500, 5),
        extra_net in prop::collection::vec(0u64..500, 5),
    ) {
        let bigger = grow(&c, &extra_mem, &extra_net);
        let small = check(&c, Policy::Uniform);
        let large = check(&bigger, Policy::Uniform);
        for (a, b) in small.quotas.per_source().iter().flatten().zip(large.quotas.per_source().iter().flatten()) {
            prop_assert!(b >= a, "uniform quota fell from {} to {}", a, b);
        }
        // Max-min: the floor and the total never fall.
        let small = check(&c, Policy::Maxmin);
        let large = check(&bigger, Policy::Maxmin);
        prop_assert!(large.retention_floor >= small.retention_floor);
    }
}

#[test]
fn weights_too_big_is_a_typed_error_naming_rank_and_shortfall() {
    let c = Case {
        counts: vec![vec![1, 1], vec![1, 1]],
        placement: Placement {
            owner: vec![1, 1],
            replicas: vec![],
        },
        budgets: vec![
            RankBudget {
                memory_bytes: 1000,
                network_bytes: 1000,
            },
            RankBudget {
                memory_bytes: 350,
                network_bytes: 1000,
            },
        ],
    };
    let cost = cost();
    assert_eq!(
        quotas(&inputs(&c, &cost), Policy::Uniform),
        Err(QuotaError::InsufficientMemory {
            rank: 1,
            needed_bytes: 400,
            budget_bytes: 350,
            shortfall_bytes: 50
        })
    );
}

#[test]
fn worked_example_uniform_and_maxmin() {
    // Two ranks, two experts owned one each; rank 0 may buffer 10 pairs,
    // rank 1 100. Expert 0 (on rank 0) gets 40 pairs, expert 1 gets 20.
    let cost = CostModel {
        expert_weight_bytes: 0,
        expert_grad_bytes: 0,
        ..cost()
    };
    let c = Case {
        counts: vec![vec![20, 10], vec![20, 10]],
        placement: Placement {
            owner: vec![0, 1],
            replicas: vec![],
        },
        budgets: vec![
            RankBudget {
                memory_bytes: 100,
                network_bytes: u64::MAX,
            },
            RankBudget {
                memory_bytes: 1000,
                network_bytes: u64::MAX,
            },
        ],
    };
    let u = quotas(&inputs(&c, &cost), Policy::Uniform).unwrap();
    // ρ* is just below 0.3: ⌊0.3·20⌋ + ⌊0.3·20⌋ = 12 would overflow rank 0.
    assert_eq!(u.quotas.per_expert(), vec![10, 4]);
    assert!(
        (0.29..0.3).contains(&u.retention_floor),
        "{}",
        u.retention_floor
    );
    let m = quotas(&inputs(&c, &cost), Policy::Maxmin).unwrap();
    assert_eq!(m.quotas.per_expert(), vec![10, 20]);
}

#[test]
fn replicas_go_to_the_hottest_expert_on_the_least_loaded_rank() {
    let cost = cost();
    let c = Case {
        counts: vec![vec![90, 5, 5], vec![90, 5, 5], vec![0, 0, 0]],
        placement: Placement {
            owner: vec![0, 1, 1],
            replicas: vec![],
        },
        budgets: vec![RankBudget::UNLIMITED; 3],
    };
    let cfg = Config {
        replica_slots_per_rank: 1,
        replica_rule: ReplicaRule::Fill,
        ..Config::default()
    };
    let p = plan(&inputs(&c, &cost), &cfg).unwrap();
    // Expert 0 takes the idle rank 2, then rank 1; with expert 0 on every
    // rank, expert 1 (tied with 2, smaller index) takes rank 0's slot.
    assert_eq!(p.replicas_added, vec![(0, 2), (0, 1), (1, 0)]);
    assert_eq!(p.placement.instances(0), vec![0, 2, 1]);
    // No slots: no replicas.
    let p = plan(&inputs(&c, &cost), &Config::default()).unwrap();
    assert!(p.replicas_added.is_empty());
}

/// With the forward held to a cap, replicas that do not pay in time are
/// placed where they bring every rank's forward rows within it; where none
/// can, the rule places what it would without the cap.
#[test]
fn a_forward_cap_places_the_replicas_that_let_the_forward_fit() {
    // Expert 0 is hot (180 of 200 pairs on rank 0); its weights are so
    // dear on this slow link that no replica pays in time.
    let cost = CostModel {
        expert_weight_bytes: 1 << 40,
        expert_grad_bytes: 1 << 40,
        ..cost()
    };
    let c = Case {
        counts: vec![vec![90, 5, 5], vec![90, 5, 5], vec![0, 0, 0]],
        placement: Placement {
            owner: vec![0, 1, 2],
            replicas: vec![],
        },
        budgets: vec![RankBudget::UNLIMITED; 3],
    };
    let cfg = Config {
        replica_slots_per_rank: 1,
        replica_memory_fraction: 1.0,
        ..Config::default()
    };
    let inputs = inputs(&c, &cost);
    let paying = plan_replicas(&inputs, &cfg).unwrap();
    assert!(paying.replicas.iter().all(Vec::is_empty), "{paying:?}");
    let busiest =
        |p: &Placement| (modelled_forward_rows(&inputs, p).into_iter()).fold(0.0f64, f64::max);
    assert_eq!(busiest(&paying), 180.0);
    // At most 100 rows a rank: expert 0 spread over ranks 0 and 1 (the
    // first of the two least loaded) fits, 95 rows each.
    let capped = plan_replicas(
        &inputs,
        &Config {
            forward_rows_cap: Some(100),
            ..cfg
        },
    )
    .unwrap();
    assert_eq!(capped.instances(0), vec![0, 1], "{capped:?}");
    assert_eq!(busiest(&capped), 95.0, "{capped:?}");
    // At most 40 rows cannot be reached with one slot a rank: unchanged.
    let out_of_reach = Config {
        forward_rows_cap: Some(40),
        ..cfg
    };
    assert_eq!(plan_replicas(&inputs, &out_of_reach).unwrap(), paying);
    // A cap the rule's own placement already meets changes nothing.
    let met = Config {
        forward_rows_cap: Some(180),
        ..cfg
    };
    assert_eq!(plan_replicas(&inputs, &met).unwrap(), paying);
}

#[test]
fn replicas_stay_within_their_memory_fraction() {
    let cost = cost();
    let c = Case {
        counts: vec![vec![100, 1], vec![1, 1]],
        placement: Placement {
            owner: vec![0, 0],
            replicas: vec![],
        },
        // Rank 1 has 500 B free: a quarter (125 B) cannot hold a 200 B replica.
        budgets: vec![
            RankBudget::UNLIMITED,
            RankBudget {
                memory_bytes: 500,
                network_bytes: u64::MAX,
            },
        ],
    };
    let cfg = Config {
        replica_slots_per_rank: 4,
        replica_rule: ReplicaRule::Fill,
        ..Config::default()
    };
    assert!(plan(&inputs(&c, &cost), &cfg)
        .unwrap()
        .replicas_added
        .is_empty());
    let cfg = Config {
        replica_slots_per_rank: 4,
        replica_memory_fraction: 0.5,
        replica_rule: ReplicaRule::Fill,
        ..Config::default()
    };
    assert_eq!(
        plan(&inputs(&c, &cost), &cfg).unwrap().replicas_added,
        vec![(0, 1)]
    );
}

#[test]
fn bad_inputs_are_typed_errors() {
    let cost = cost();
    let c = Case {
        counts: vec![vec![1]],
        placement: Placement {
            owner: vec![3],
            replicas: vec![],
        },
        budgets: vec![RankBudget::UNLIMITED],
    };
    assert!(matches!(
        quotas(&inputs(&c, &cost), Policy::Uniform),
        Err(QuotaError::BadRank { rank: 3, .. })
    ));
    // A rank holding two instances of one expert: a replica on its owner,
    // or the same replica twice; out of range among the replicas.
    for (replicas, rank) in [(vec![1, 0], 0), (vec![2, 1, 2], 2), (vec![1, 4], 4)] {
        let c = Case {
            counts: vec![vec![1]; 3],
            placement: Placement {
                owner: vec![0],
                replicas: vec![replicas.clone()],
            },
            budgets: vec![RankBudget::UNLIMITED; 3],
        };
        let got = quotas(&inputs(&c, &cost), Policy::Uniform);
        assert!(
            matches!(got, Err(QuotaError::BadRank { expert: 0, rank: r, n_ranks: 3 }) if r == rank),
            "{replicas:?}: {got:?}"
        );
    }
    let c = Case {
        counts: vec![vec![1, 2]],
        placement: Placement {
            owner: vec![0],
            replicas: vec![],
        },
        ..c
    };
    assert!(matches!(
        quotas(&inputs(&c, &cost), Policy::Uniform),
        Err(QuotaError::Shape { .. })
    ));
    let c = Case {
        counts: vec![vec![1]],
        ..c
    };
    let bad = CostModel {
        flops_per_s: f64::NAN,
        ..cost
    };
    assert!(matches!(
        quotas(&inputs(&c, &bad), Policy::Uniform),
        Err(QuotaError::BadCost {
            field: "flops_per_s",
            ..
        })
    ));
}

#[test]
fn zero_ranks_and_experts_are_ordinary() {
    let cost = cost();
    let c = Case {
        counts: vec![],
        placement: Placement {
            owner: vec![],
            replicas: vec![],
        },
        budgets: vec![],
    };
    let p = quotas(&inputs(&c, &cost), Policy::Maxmin).unwrap();
    assert_eq!(p.quotas.total(), 0);
    let c = Case {
        counts: vec![vec![], vec![]],
        placement: Placement {
            owner: vec![],
            replicas: vec![],
        },
        budgets: vec![RankBudget::UNLIMITED; 2],
    };
    assert_eq!(
        quotas(&inputs(&c, &cost), Policy::Uniform)
            .unwrap()
            .ranks
            .len(),
        2
    );
}

fn near_max() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..100, (u64::MAX - 100)..=u64::MAX, Just(1u64 << 63)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Counts at the u64 limits: either a typed overflow (exactly when the
    /// total does not fit) or a plan that keeps its invariants.
    #[test]
    fn counts_at_the_u64_limits_overflow_as_an_error_or_plan_correctly(
        counts in prop::collection::vec(prop::collection::vec(near_max(), 2), 2),
        budget in prop_oneof![Just(u64::MAX), 0u64..10_000],
        slots in 0usize..2,
    ) {
        let placement = Placement { owner: vec![0, 1], replicas: vec![] };
        let budgets = vec![
            RankBudget { memory_bytes: budget.saturating_add(200), network_bytes: u64::MAX };
            2
        ];
        let inputs = Inputs { counts: &counts, placement: &placement, cost: &cost(), budgets: &budgets };
        let cfg = Config { policy: Policy::Maxmin, replica_slots_per_rank: slots, replica_memory_fraction: 1.0, replica_rule: ReplicaRule::Paying, forward_rows_cap: None };
        let total: u128 = counts.iter().flatten().map(|&c| u128::from(c)).sum();
        match plan(&inputs, &cfg) {
            Err(QuotaError::Overflow { .. }) => prop_assert!(total > u128::from(u64::MAX)),
            Err(e) => prop_assert!(false, "unexpected error {e}"),
            Ok(p) => {
                prop_assert!(total <= u128::from(u64::MAX));
                prop_assert!(p.kept_fraction <= 1.0 && p.kept_fraction >= 0.0);
                for (s, row) in p.quotas.per_source().iter().enumerate() {
                    for (e, &k) in row.iter().enumerate() {
                        prop_assert!(k <= counts[s][e]);
                    }
                }
            }
        }
    }
}

/// The replica planner as first written (quadratic scans per step): the reference
/// the heap-based planner must match exactly.
/// Also returns the replicas in the order they were added.
fn naive_plan_replicas(
    inputs: &Inputs<'_>,
    cfg: &Config,
) -> Result<(Placement, Vec<(usize, usize)>), QuotaError> {
    inputs.validate()?;
    if !(0.0..=1.0).contains(&cfg.replica_memory_fraction) {
        return Err(QuotaError::BadFraction {
            field: "replica_memory_fraction",
            value: cfg.replica_memory_fraction,
        });
    }
    let (n_ranks, n_experts) = (inputs.n_ranks(), inputs.n_experts());
    let mut placement = inputs.placement.clone();
    placement.replicas.resize(n_experts, Vec::new());
    let stat = static_bytes(inputs, &placement);
    let inst_bytes = inputs.cost.instance_bytes();
    let mut replica_room: Vec<u64> = (0..n_ranks)
        .map(|r| {
            let free = inputs.budgets[r].memory_bytes.saturating_sub(stat[r]);
            (free as f64 * cfg.replica_memory_fraction) as u64
        })
        .collect();
    let mut slots: Vec<usize> = (0..n_ranks)
        .map(|r| {
            let hosted = placement.replicas.iter().filter(|v| v.contains(&r)).count();
            cfg.replica_slots_per_rank.saturating_sub(hosted)
        })
        .collect();
    let routed = inputs.routed_per_expert();
    let per_instance =
        |e: usize, p: &Placement| routed[e] as f64 / (1 + p.replicas[e].len()) as f64;
    let mut rank_load = vec![0.0f64; n_ranks];
    for e in 0..n_experts {
        for r in placement.instances(e) {
            rank_load[r] += per_instance(e, &placement);
        }
    }
    let mut exhausted = vec![false; n_experts];
    let mut added = Vec::new();
    while let Some(e) = (0..n_experts)
        .filter(|&e| !exhausted[e] && routed[e] > 0)
        .max_by(|&a, &b| {
            per_instance(a, &placement)
                .total_cmp(&per_instance(b, &placement))
                .then(b.cmp(&a))
        })
    {
        let inst = placement.instances(e);
        let target = (0..n_ranks)
            .filter(|&r| !inst.contains(&r) && slots[r] > 0 && replica_room[r] >= inst_bytes)
            .min_by(|&a, &b| rank_load[a].total_cmp(&rank_load[b]).then(a.cmp(&b)));
        let Some(r) = target else {
            exhausted[e] = true;
            continue;
        };
        let old = per_instance(e, &placement);
        placement.replicas[e].push(r);
        added.push((e, r));
        let new = per_instance(e, &placement);
        for &i in &inst {
            rank_load[i] += new - old;
        }
        rank_load[r] += new;
        slots[r] -= 1;
        replica_room[r] -= inst_bytes;
    }
    Ok((placement, added))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn replica_planner_matches_the_naive_reference(
        c in case_strategy(),
        slots in 0usize..4,
        fraction in prop_oneof![Just(1.0f64), 0.0f64..1.0],
        big_budget in any::<bool>(),
    ) {
        let mut c = c;
        if big_budget {
            c.budgets.iter_mut().for_each(|b| b.memory_bytes = b.memory_bytes.saturating_mul(50));
        }
        let inputs = Inputs { counts: &c.counts, placement: &c.placement, cost: &cost(), budgets: &c.budgets };
        let cfg = Config { policy: Policy::Uniform, replica_slots_per_rank: slots, replica_memory_fraction: fraction, replica_rule: ReplicaRule::Fill, forward_rows_cap: None };
        prop_assert_eq!(plan_replicas(&inputs, &cfg), naive_plan_replicas(&inputs, &cfg).map(|(p, _)| p));
    }
}

/// The modelled split by bisection on each expert's level: the pairs
/// each rank serves (`load`) and, per expert, each rank's share.
fn naive_split(inputs: &Inputs<'_>, p: &Placement) -> (Vec<f64>, Vec<Vec<f64>>) {
    let routed = inputs.routed_per_expert();
    let mut experts: Vec<usize> = (0..routed.len()).collect();
    experts.sort_by_key(|&e| (p.instances(e).len(), std::cmp::Reverse(routed[e]), e));
    let mut load = vec![0.0f64; inputs.n_ranks()];
    // served[e][r]: the pairs of expert e that rank r serves.
    let mut served = vec![vec![0.0f64; inputs.n_ranks()]; routed.len()];
    for &e in &experts {
        let inst = p.instances(e);
        let poured = |level: f64| {
            inst.iter()
                .map(|&r| (level - load[r]).max(0.0))
                .sum::<f64>()
        };
        let (mut lo, mut hi) = (
            0.0,
            routed[e] as f64 + load.iter().fold(0.0f64, |a, &b| a.max(b)),
        );
        for _ in 0..200 {
            let mid = 0.5 * (lo + hi);
            if poured(mid) < routed[e] as f64 {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        for &r in &inst {
            served[e][r] = (hi - load[r]).max(0.0);
            load[r] = load[r].max(hi);
        }
    }
    (load, served)
}

/// The crate doc's `T` the slow way: each expert (fewest instances
/// first, then largest, then smaller id) raises its instances' loads to
/// the level its pairs fill, found by bisection; traffic counted rank by
/// rank from the instances. The reference for [`modelled_call_seconds`].
fn naive_call_seconds(inputs: &Inputs<'_>, p: &Placement) -> f64 {
    let c = inputs.cost;
    let routed = inputs.routed_per_expert();
    let per_pair = (c.flops_per_pair + c.forward_flops_per_pair) / c.flops_per_s;
    let (load, served) = naive_split(inputs, p);
    // Phase by phase, each ending with its busiest rank and direction:
    // the expert work, the replicas' weights and gradients, then the four
    // token exchanges. Without the rows, each rank's compute and replica
    // traffic, the slowest rank's sum.
    let compute = load.iter().fold(0.0f64, |a, &l| a.max(l * per_pair));
    let mut replicas = 0.0f64;
    let mut summed = 0.0f64;
    for (r, &pairs) in load.iter().enumerate() {
        let (mut got, mut sent) = (0.0, 0.0);
        for e in 0..routed.len() {
            let inst = p.instances(e);
            let reps = (inst.len() - 1) as f64;
            if inst[0] == r {
                sent += reps * c.expert_weight_bytes as f64;
                got += reps * c.expert_grad_bytes as f64;
            } else if inst.contains(&r) {
                got += c.expert_weight_bytes as f64;
                sent += c.expert_grad_bytes as f64;
            }
        }
        replicas = replicas.max(got).max(sent);
        summed = summed.max(pairs * per_pair + got.max(sent) / c.link_bytes_per_s);
    }
    let x = c.exchange_row_bytes as f64;
    if x == 0.0 {
        return summed;
    }
    let mut exchanges = 0.0;
    // (bytes a pair carries, whether it goes to the serving rank).
    let phases = [
        (x, true),
        (x, false),
        (c.row_bytes() as f64, true),
        (x, false),
    ];
    for (bytes, to_server) in phases {
        let mut worst = 0.0f64;
        for (r, own) in inputs.counts.iter().enumerate() {
            let (mut got, mut sent) = (0.0, 0.0);
            for (e, &n) in routed.iter().enumerate() {
                if n == 0 {
                    continue;
                }
                let (n, mine) = (n as f64, own[e] as f64);
                // Served here for other ranks; this rank's pairs served
                // elsewhere.
                let remote_in = served[e][r] * (n - mine) / n;
                let away = mine * (1.0 - served[e][r] / n);
                if to_server {
                    got += remote_in * bytes;
                    sent += away * bytes;
                } else {
                    got += away * bytes;
                    sent += remote_in * bytes;
                }
            }
            worst = worst.max(got).max(sent);
        }
        exchanges += worst;
    }
    compute + (replicas + exchanges) / c.link_bytes_per_s
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The paying rule keeps the prefix of the greedy's sequence with the
    /// smallest modelled time (the shortest such), so it is never slower
    /// in the model than no replicas or all of them.
    #[test]
    fn paying_replicas_are_the_best_prefix_of_the_greedy(
        c in case_strategy(),
        slots in 0usize..4,
        weight in 1u64..120,
        flops_per_pair in 1e2f64..1e5,
        forward in prop_oneof![Just(0.0f64), 1e2f64..1e4],
        exchange_row_bytes in prop_oneof![Just(0u64), 1u64..8],
    ) {
        let cost = CostModel {
            expert_weight_bytes: weight,
            expert_grad_bytes: weight + 3,
            flops_per_pair,
            forward_flops_per_pair: forward,
            exchange_row_bytes,
            ..cost()
        };
        let mut c = c;
        c.budgets.iter_mut().for_each(|b| b.memory_bytes = b.memory_bytes.saturating_mul(50));
        let inputs = Inputs { counts: &c.counts, placement: &c.placement, cost: &cost, budgets: &c.budgets };
        let fill = Config { policy: Policy::Uniform, replica_slots_per_rank: slots, replica_memory_fraction: 1.0, replica_rule: ReplicaRule::Fill, forward_rows_cap: None };
        let (_, order) = naive_plan_replicas(&inputs, &fill).unwrap();
        let paying = plan_replicas(&inputs, &Config { replica_rule: ReplicaRule::Paying, ..fill }).unwrap();
        // One pass gives both what the rule places and every slot filled.
        let filled = plan_replicas(&inputs, &fill).unwrap();
        for rule in [ReplicaRule::Fill, ReplicaRule::Paying, ReplicaRule::PayingCompute] {
            let cfg = Config { replica_rule: rule, ..fill };
            let alone = plan_replicas(&inputs, &cfg).unwrap();
            prop_assert_eq!(plan_replicas_and_fill(&inputs, &cfg).unwrap(), (alone, filled.clone()));
        }
        let t = modelled_call_seconds(&inputs, &paying);
        let tol = 1e-9 * t.max(1e-30);
        prop_assert!((t - naive_call_seconds(&inputs, &paying)).abs() <= tol);
        // Every prefix's time, and which prefix the rule kept.
        let mut prefix = c.placement.clone();
        prefix.replicas.resize(c.placement.owner.len(), Vec::new());
        let mut times = vec![naive_call_seconds(&inputs, &prefix)];
        let mut kept = (prefix == paying).then_some(0);
        for (k, &(e, r)) in order.iter().enumerate() {
            prefix.replicas[e].push(r);
            times.push(naive_call_seconds(&inputs, &prefix));
            if kept.is_none() && prefix == paying {
                kept = Some(k + 1);
            }
        }
        let Some(k) = kept else {
            return Err(TestCaseError::fail("not a prefix of the greedy's replicas"));
        };
        prop_assert!(times.iter().all(|&x| t <= x + tol), "{t} vs {times:?}");
        prop_assert!(times[..k].iter().all(|&x| x > t - tol), "a shorter prefix is as fast: {times:?}");
    }

    /// With the forward held to a cap, the paying rule keeps its own
    /// prefix of the greedy's replicas where its busiest rank's forward
    /// rows fit, and otherwise the shortest longer prefix that fits, or its
    /// own where none does; the public forward rows are the naive split's.
    #[test]
    fn a_forward_cap_takes_the_first_longer_prefix_that_fits(
        c in case_strategy(),
        slots in 1usize..4,
        weight in 1u64..120,
        flops_per_pair in 1e2f64..1e5,
        cap_share in 0.0f64..1.2,
    ) {
        let cost = CostModel { expert_weight_bytes: weight, expert_grad_bytes: weight + 3, flops_per_pair, ..cost() };
        let mut c = c;
        c.budgets.iter_mut().for_each(|b| b.memory_bytes = b.memory_bytes.saturating_mul(50));
        let inputs = Inputs { counts: &c.counts, placement: &c.placement, cost: &cost, budgets: &c.budgets };
        let fill = Config { policy: Policy::Uniform, replica_slots_per_rank: slots, replica_memory_fraction: 1.0, replica_rule: ReplicaRule::Fill, forward_rows_cap: None };
        let (_, order) = naive_plan_replicas(&inputs, &fill).unwrap();
        let paying_cfg = Config { replica_rule: ReplicaRule::Paying, ..fill };
        let paying = plan_replicas(&inputs, &paying_cfg).unwrap();
        let mut prefix = c.placement.clone();
        prefix.replicas.resize(c.placement.owner.len(), Vec::new());
        let mut prefixes = vec![prefix.clone()];
        for &(e, r) in &order {
            prefix.replicas[e].push(r);
            prefixes.push(prefix.clone());
        }
        let busiest = |p: &Placement| naive_split(&inputs, p).0.into_iter().fold(0.0f64, f64::max);
        let total: u64 = c.counts.iter().flatten().sum();
        let cap = (cap_share * total as f64) as u64;
        // Away from the boundary, where the naive bisection and the exact
        // level could disagree by rounding.
        prop_assume!(prefixes.iter().all(|p| (busiest(p) - cap as f64).abs() > 1e-6 * (cap as f64).max(1.0)));
        let Some(k) = prefixes.iter().position(|p| *p == paying) else {
            return Err(TestCaseError::fail("not a prefix of the greedy's replicas"));
        };
        let fits = |j: usize| busiest(&prefixes[j]) <= cap as f64;
        let want = if fits(k) { k } else { (k + 1..prefixes.len()).find(|&j| fits(j)).unwrap_or(k) };
        let capped = plan_replicas(&inputs, &Config { forward_rows_cap: Some(cap), ..paying_cfg }).unwrap();
        prop_assert_eq!(&capped, &prefixes[want]);
        let naive = naive_split(&inputs, &capped).0;
        for (a, b) in modelled_forward_rows(&inputs, &capped).into_iter().zip(naive) {
            prop_assert!((a - b).abs() <= 1e-6 * b.max(1.0), "{a} vs {b}");
        }
    }

    /// The modelled split neither loses nor invents pairs: without traffic
    /// the slowest rank serves between the mean and all of them.
    #[test]
    fn the_split_model_conserves_pairs(c in case_strategy()) {
        let cost = CostModel { link_bytes_per_s: f64::MAX, ..cost() };
        let inputs = Inputs { counts: &c.counts, placement: &c.placement, cost: &cost, budgets: &c.budgets };
        let total: u64 = c.counts.iter().flatten().sum();
        let per_pair = (cost.flops_per_pair + cost.forward_flops_per_pair) / cost.flops_per_s;
        let t = modelled_call_seconds(&inputs, &c.placement);
        // The slowest rank serves at least the mean and at most every pair.
        let n = c.budgets.len() as f64;
        prop_assert!(t >= total as f64 / n * per_pair * (1.0 - 1e-9));
        prop_assert!(t <= total as f64 * per_pair * (1.0 + 1e-9));
    }
}

/// `cfg`'s plan with the paying rule and with every slot filled.
fn paying_and_filled(c: &Case, cost: &CostModel, cfg: Config) -> (Plan, Plan) {
    let with = |replica_rule| {
        plan(
            &inputs(c, cost),
            &Config {
                replica_rule,
                ..cfg
            },
        )
        .unwrap()
    };
    (with(ReplicaRule::Paying), with(ReplicaRule::Fill))
}

#[test]
fn a_replica_pays_once_it_moves_more_pairs_than_its_weights_cost() {
    // SwiGLU in bf16 on an H200, exchanges left out: moving m pairs saves
    // m·22·h·f / F s, the replica's weights take 6·h·f / L s each way, so
    // it pays once m > 6·F / (22·L) ≈ 484.8, whatever the shape.
    let break_even = 6.0 * H200_FLOPS_PER_S / (22.0 * H200_LINK_BYTES_PER_S);
    assert!((484.0..486.0).contains(&break_even), "{break_even}");
    for (hidden, ffn) in [(2048, 768), (512, 256)] {
        let cost = CostModel {
            exchange_row_bytes: 0,
            ..CostModel::swiglu_expert(hidden, ffn, 2, H200_LINK_BYTES_PER_S, H200_FLOPS_PER_S)
        };
        // Rank 0 owns the hot expert, rank 1 an idle one: a replica on
        // rank 1 moves half the hot expert's pairs.
        for (hot, pays) in [(960u64, false), (980, true), (100, false), (20_000, true)] {
            assert_eq!(
                replicas_placed(&cost, vec![vec![hot, 0], vec![0, 0]]),
                usize::from(pays),
                "{hidden}×{ffn}, {hot} pairs"
            );
        }
    }
}

#[test]
fn a_replica_weighs_the_token_rows_it_moves() {
    // The same with the call's token exchanges (`exchange_row_bytes`): a
    // remote pair moves 6·h bytes to the rank that serves it (x, then
    // [x | δ]) and 4·h back, 10·h in all. Half of m pairs served on a
    // replica:
    // - all routed from the owner's rank: they now cross the link, so the
    //   replica pays only once m·(22·h·f/F − 10·h/L) > 6·h·f/L, and never
    //   where 22·f·L/F ≤ 10 (the A3B and qwen3-moe-mini experts over
    //   NVLink);
    // - all routed from the replica's rank: they stop crossing it, so it
    //   pays once m·(22·h·f/F + 10·h/L) > 6·h·f/L.
    let ratio = H200_LINK_BYTES_PER_S / H200_FLOPS_PER_S;
    for (hidden, ffn) in [(2048usize, 768usize), (512, 256), (1024, 2048)] {
        let cost =
            CostModel::swiglu_expert(hidden, ffn, 2, H200_LINK_BYTES_PER_S, H200_FLOPS_PER_S);
        assert_eq!(cost.exchange_row_bytes, 2 * hidden as u64);
        let f = ffn as f64;
        let local = 22.0 * f * ratio - 10.0;
        assert_eq!(local > 0.0, ffn == 2048, "{ffn}");
        let remote = 6.0 * f / (22.0 * f * ratio + 10.0);
        // From the owner's rank.
        let cases: Vec<(u64, bool)> = if local > 0.0 {
            let m = 6.0 * f / local;
            vec![((2.0 * m) as u64 - 4, false), ((2.0 * m) as u64 + 4, true)]
        } else {
            vec![(2_000, false), (2_000_000, false)]
        };
        for (hot, pays) in cases {
            assert_eq!(
                replicas_placed(&cost, vec![vec![hot, 0], vec![0, 0]]),
                usize::from(pays),
                "{hidden}×{ffn}, {hot} pairs from the owner's rank"
            );
        }
        // From the replica's rank.
        for (hot, pays) in [
            ((2.0 * remote) as u64 - 4, false),
            ((2.0 * remote) as u64 + 4, true),
        ] {
            assert_eq!(
                replicas_placed(&cost, vec![vec![0, 0], vec![hot, 0]]),
                usize::from(pays),
                "{hidden}×{ffn}, {hot} pairs from the other rank"
            );
        }
    }
}

/// How many replicas the paying rule places for `counts` (2 ranks, rank
/// r owning expert r, one slot each, no budget); filling the slots always
/// places one, on rank 1.
fn replicas_placed(cost: &CostModel, counts: Vec<Vec<u64>>) -> usize {
    let c = two_ranks(counts);
    let cfg = Config {
        replica_slots_per_rank: 1,
        ..Config::default()
    };
    let (p, fill) = paying_and_filled(&c, cost, cfg);
    assert_eq!(fill.replicas_added, vec![(0, 1)]);
    p.replicas_added.len()
}

/// Two ranks, rank r owning expert r, no budget.
fn two_ranks(counts: Vec<Vec<u64>>) -> Case {
    Case {
        counts,
        placement: Placement {
            owner: vec![0, 1],
            replicas: vec![],
        },
        budgets: vec![RankBudget::UNLIMITED; 2],
    }
}

#[test]
fn an_empty_slot_leaves_its_memory_to_the_buffers() {
    // Even load: no replica pays, so the slot's reserved bytes hold rows.
    let cost = CostModel::swiglu_expert(512, 256, 2, H200_LINK_BYTES_PER_S, H200_FLOPS_PER_S);
    let budget = RankBudget {
        memory_bytes: 2 * cost.instance_bytes() + 100 * cost.row_bytes(),
        network_bytes: u64::MAX,
    };
    let c = Case {
        counts: vec![vec![300, 250], vec![250, 300]],
        placement: Placement {
            owner: vec![0, 1],
            replicas: vec![],
        },
        budgets: vec![budget; 2],
    };
    let cfg = Config {
        replica_slots_per_rank: 1,
        replica_memory_fraction: 1.0,
        ..Config::default()
    };
    let (paying, fill) = paying_and_filled(&c, &cost, cfg);
    assert!(paying.replicas_added.is_empty());
    assert_eq!(fill.replicas_added.len(), 2);
    let per_row = cost.instance_bytes() / cost.row_bytes();
    assert_eq!(paying.ranks[0].pair_capacity, 100 + per_row);
    assert_eq!(fill.ranks[0].pair_capacity, 100);
    assert!(paying.kept_fraction > fill.kept_fraction);
}

#[test]
fn the_swiglu_expert_cost_model_counts_rows_and_three_matrices() {
    let c = CostModel::swiglu_expert(2048, 768, 2, H200_LINK_BYTES_PER_S, H200_FLOPS_PER_S);
    assert_eq!(c.row_bytes(), 2 * 2048 * 2);
    assert_eq!(c.instance_bytes(), 2 * 3 * 2048 * 768 * 2);
    assert_eq!(c.flops_per_pair, 16.0 * 2048.0 * 768.0);
    // Absurd sizes saturate instead of wrapping.
    let huge = CostModel::swiglu_expert(usize::MAX, usize::MAX, 8, 1.0, 1.0);
    assert_eq!(huge.instance_bytes(), u64::MAX);
}

/// Random `[source][expert]` routed counts and kept counts below them.
fn kept_strategy() -> impl Strategy<Value = (Vec<Vec<u64>>, Vec<Vec<u64>>)> {
    (1usize..4, 1usize..6)
        .prop_flat_map(|(s, e)| {
            prop::collection::vec(prop::collection::vec((0u64..700, 0.0f64..=1.0), e), s)
        })
        .prop_map(|cells| {
            let routed = cells
                .iter()
                .map(|row| row.iter().map(|&(n, _)| n).collect())
                .collect();
            let kept = cells
                .iter()
                .map(|row| row.iter().map(|&(n, f)| (n as f64 * f) as u64).collect())
                .collect();
            (routed, kept)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn tile_alignment_only_trims_small_remainders_of_binding_quotas(
        (routed, kept) in kept_strategy(),
        tile in prop_oneof![Just(0u64), 1u64..200],
        max_drop in prop_oneof![Just(0.0f64), Just(1.0), 0.0f64..0.5],
    ) {
        let mut out = kept.clone();
        let dropped = align_to_tiles(&mut out, &routed, tile, max_drop).unwrap();
        let col = |m: &[Vec<u64>], e: usize| -> u64 { m.iter().map(|r| r[e]).sum() };
        let mut total = 0;
        for e in 0..routed[0].len() {
            let (q, q2, n) = (col(&kept, e), col(&out, e), col(&routed, e));
            // Never more, cell by cell.
            for (a, b) in kept.iter().zip(&out) {
                prop_assert!(b[e] <= a[e]);
            }
            total += q - q2;
            if q2 != q {
                // Only binding quotas of at least one tile, down to a whole
                // number of tiles, by at most max_drop of the quota.
                prop_assert!(q < n && q >= tile && tile > 0);
                prop_assert_eq!(q2 % tile, 0);
                prop_assert_eq!(q2, q - q % tile);
                prop_assert!((q - q2) as f64 <= max_drop * q as f64);
                // Taken from the last sources first: a source loses pairs only
                // if every later source is down to zero for this expert.
                let changed: Vec<bool> = kept.iter().zip(&out).map(|(a, b)| b[e] != a[e]).collect();
                if let Some(first) = changed.iter().position(|&c| c) {
                    for later in &out[first + 1..] {
                        prop_assert_eq!(later[e], 0);
                    }
                }
            } else if tile > 0 && q < n && q >= tile && q % tile != 0 {
                // Left alone only when the remainder is too large to drop.
                prop_assert!((q % tile) as f64 > max_drop * q as f64);
            }
        }
        prop_assert_eq!(dropped, total);
        // Aligning again changes nothing.
        let mut again = out.clone();
        prop_assert_eq!(align_to_tiles(&mut again, &routed, tile, max_drop).unwrap(), 0);
        prop_assert_eq!(again, out);
    }
}

#[test]
fn tile_alignment_refuses_bad_input() {
    let routed = vec![vec![300u64, 10]];
    let mut kept = vec![vec![260u64, 10]];
    assert!(matches!(
        align_to_tiles(&mut kept, &routed, 128, 1.5),
        Err(QuotaError::BadFraction { .. })
    ));
    assert!(matches!(
        align_to_tiles(&mut kept, &routed, 128, f64::NAN),
        Err(QuotaError::BadFraction { .. })
    ));
    assert!(matches!(
        align_to_tiles(&mut kept, &[vec![300u64]], 128, 0.1),
        Err(QuotaError::Shape { .. })
    ));
    let mut over = vec![vec![301u64, 10]];
    assert!(matches!(
        align_to_tiles(&mut over, &routed, 128, 0.1),
        Err(QuotaError::Shape { .. })
    ));
    // Nothing was changed by the refused calls; a good one trims 260 to 256.
    assert_eq!(kept, vec![vec![260, 10]]);
    assert_eq!(
        align_to_tiles(&mut kept, &routed, 128, 1.0 / 16.0).unwrap(),
        4
    );
    assert_eq!(kept, vec![vec![256, 10]]);
}

// The controller's quotas against an independent exact optimizer: a linear
// program (good_lp's microlp) over the same model, written from the crate
// documentation's formulas and not from its code.
//
// The model: rank `r` processes at most `cap_r = min(⌊free_r / row⌋,
// ⌊network_r / row⌋)` pairs (`free_r` = memory budget less its instances'
// bytes) and source `s` keeps at most `⌊network_s / row⌋`; a cell's kept
// pairs go to the instances of its expert. Its constraint matrix is a flow
// network's, so the linear program's optima are integral.
//
// * Uniform and max-min share the retention floor `ρ* = j / 2²⁰`: keeping
//   `⌊ρ·n⌋` of every cell is feasible at `j` and infeasible at `j + 1`.
// * Max-min keeps the largest total any integral quota vector with
//   `⌊ρ*·n⌋ ≤ k ≤ n` can keep within the caps.

const LP_DEN: u64 = 1 << 20;

/// Half the cases are memory-only (the controller's per-expert network).
fn unlimited_sends(mut c: Case, memory_only: bool) -> Case {
    if memory_only {
        c.budgets
            .iter_mut()
            .for_each(|b| b.network_bytes = u64::MAX);
    }
    c
}

/// `(cap_r, send_s)` from the documented formulas; `None` is unlimited.
fn caps(c: &Case) -> (Vec<Option<u64>>, Vec<Option<u64>>) {
    let cost = cost();
    let row = cost.row_bytes();
    let inst = c.placement.instances_per_rank(c.budgets.len());
    let per = |b: u64| (b != u64::MAX).then_some(b / row);
    let cap = c
        .budgets
        .iter()
        .zip(&inst)
        .map(|(b, &i)| {
            let mem = per(b.memory_bytes - i * cost.instance_bytes());
            match (mem, per(b.network_bytes)) {
                (Some(m), Some(n)) => Some(m.min(n)),
                (m, n) => m.or(n),
            }
        })
        .collect();
    let send = c.budgets.iter().map(|b| per(b.network_bytes)).collect();
    (cap, send)
}

fn floor_at(n: u64, j: u64) -> u64 {
    (u128::from(n) * u128::from(j) / u128::from(LP_DEN)) as u64
}

/// Largest total of kept pairs with `lo ≤ k ≤ hi` per cell within the caps,
/// or `None` when even `lo` cannot be placed.
fn best_total(c: &Case, lo: &[Vec<u64>], hi: &[Vec<u64>]) -> Option<f64> {
    let (cap, send) = caps(c);
    let n_ranks = c.budgets.len();
    let instances = c.placement.all_instances();
    let mut vars = ProblemVariables::new();
    // x[s][e][i]: pairs of cell (s, e) processed on instance i of e.
    let x: Vec<Vec<Vec<_>>> = (0..n_ranks)
        .map(|_| {
            instances
                .iter()
                .map(|inst| inst.iter().map(|_| vars.add(variable().min(0.0))).collect())
                .collect()
        })
        .collect();
    let total: Expression = x.iter().flatten().flatten().copied().sum();
    let mut model = vars.maximise(total.clone()).using(good_lp::microlp);
    for s in 0..n_ranks {
        let mut sent = Expression::from(0.0);
        for (e, inst) in instances.iter().enumerate() {
            let cell: Expression = x[s][e].iter().copied().sum();
            model = model.with(constraint!(cell.clone() >= lo[s][e] as f64));
            model = model.with(constraint!(cell.clone() <= hi[s][e] as f64));
            if inst.is_empty() && lo[s][e] > 0 {
                return None;
            }
            sent += cell;
        }
        if let Some(cap) = send[s] {
            model = model.with(constraint!(sent <= cap as f64));
        }
    }
    for (r, cap) in cap.iter().enumerate() {
        let Some(cap) = cap else { continue };
        let mut load = Expression::from(0.0);
        for xs in &x {
            for (e, inst) in instances.iter().enumerate() {
                for (i, &host) in inst.iter().enumerate() {
                    if host == r {
                        load += xs[e][i];
                    }
                }
            }
        }
        model = model.with(constraint!(load <= *cap as f64));
    }
    match model.solve() {
        Ok(sol) => Some(sol.eval(&total)),
        Err(good_lp::ResolutionError::Infeasible) => None,
        Err(e) => panic!("LP failed: {e}"),
    }
}

fn floors_at(c: &Case, j: u64) -> Vec<Vec<u64>> {
    c.counts
        .iter()
        .map(|row| row.iter().map(|&n| floor_at(n, j)).collect())
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 160, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn the_retention_floor_is_the_largest_feasible_one(c in case_strategy(), memory_only in any::<bool>()) {
        let c = unlimited_sends(c, memory_only);
        let cost = cost();
        let inputs = inputs(&c, &cost);
        for policy in [Policy::Uniform, Policy::Maxmin] {
            let plan = quotas(&inputs, policy).expect("budgets hold the experts");
            let j = (plan.retention_floor * LP_DEN as f64).round() as u64;
            let floor = floors_at(&c, j);
            prop_assert!(best_total(&c, &floor, &floor).is_some(), "{policy:?}: floor {j}/2^20 infeasible");
            if j < LP_DEN {
                let above = floors_at(&c, j + 1);
                prop_assert!(
                    best_total(&c, &above, &above).is_none(),
                    "{policy:?}: floor {j}/2^20 is not the largest feasible one"
                );
            }
            if policy == Policy::Uniform {
                prop_assert_eq!(plan.quotas.per_source(), floor.as_slice());
            }
        }
    }

    #[test]
    fn maxmin_keeps_the_most_pairs_above_the_floor(c in case_strategy(), memory_only in any::<bool>()) {
        let c = unlimited_sends(c, memory_only);
        let cost = cost();
        let inputs = inputs(&c, &cost);
        let plan = quotas(&inputs, Policy::Maxmin).expect("budgets hold the experts");
        let j = (plan.retention_floor * LP_DEN as f64).round() as u64;
        let k = plan.quotas.per_source();
        let floor = floors_at(&c, j);
        for (s, row) in k.iter().enumerate() {
            for (e, &q) in row.iter().enumerate() {
                prop_assert!(floor[s][e] <= q && q <= c.counts[s][e], "cell ({s}, {e}) = {q}");
            }
        }
        // The plan's own quotas are placeable, and nothing keeps more.
        prop_assert!(best_total(&c, k, k).is_some(), "max-min quotas are not placeable");
        let best = best_total(&c, &floor, &c.counts).expect("the floor is feasible");
        prop_assert!(
            (plan.quotas.total() as f64 - best).abs() < 1e-6,
            "max-min keeps {} pairs, the optimum is {best}", plan.quotas.total()
        );
    }
}

#[test]
fn replicas_by_load_follow_the_previous_load_within_the_slots() {
    // 8 experts owned two per rank on 4 ranks; expert 0 carries most of
    // the previous call's load.
    let placement = Placement {
        owner: vec![0, 0, 1, 1, 2, 2, 3, 3],
        replicas: vec![],
    };
    let load = [800, 10, 10, 10, 10, 10, 10, 10];
    let p = replicas_by_load(&placement, &load, 4, 1).unwrap();
    assert_eq!(p.owner, placement.owner);
    // Four slots in all, all to the hot expert, but it fits on only the
    // three ranks that do not own it.
    assert_eq!(p.replicas[0], vec![1, 2, 3]);
    let used: usize = p.replicas.iter().map(Vec::len).sum();
    assert!(used <= 4);
    for (e, r) in p.replicas.iter().enumerate() {
        assert!(
            !r.contains(&p.owner[e]),
            "expert {e} replicated on its owner"
        );
    }
    // Slots respected per rank.
    for rank in 0..4 {
        assert!(p.replicas.iter().filter(|r| r.contains(&rank)).count() <= 1);
    }
    assert!(replicas_by_load(&placement, &load[..3], 4, 1).is_err());
    assert_eq!(largest_remainder(&[1.0, 1.0, 2.0], 4.0, 5), vec![1, 1, 3]);
}

#[test]
fn empty_replica_slots_come_out_of_the_budgets() {
    let cost = CostModel::swiglu_expert(64, 32, 2, H200_LINK_BYTES_PER_S, H200_FLOPS_PER_S);
    let inst = cost.instance_bytes();
    let given = Placement {
        owner: vec![0, 1, 2],
        replicas: vec![vec![], vec![], vec![]],
    };
    // Rank 2 hosts one new replica of expert 0; ranks 0 and 1 none.
    let with = Placement {
        owner: vec![0, 1, 2],
        replicas: vec![vec![2], vec![], vec![]],
    };
    let b = |m| RankBudget {
        memory_bytes: m,
        network_bytes: 7,
    };
    let budgets = [b(10 * inst), b(u64::MAX), b(10 * inst)];
    let out = budgets_without_empty_slots(&budgets, 2, &given, &with, &cost);
    assert_eq!(out, vec![b(8 * inst), b(u64::MAX), b(9 * inst)]);
    // No slots: nothing reserved; a budget smaller than its slots: zero.
    assert_eq!(
        budgets_without_empty_slots(&budgets, 0, &given, &with, &cost),
        budgets.to_vec()
    );
    let small = [b(inst), b(inst), b(inst)];
    assert_eq!(
        budgets_without_empty_slots(&small, 3, &given, &with, &cost),
        vec![b(0), b(0), b(0)]
    );
}

#[test]
fn paying_compute_is_the_paying_rule_without_the_rows() {
    // 700 pairs from the other rank: half of them on a replica repays the
    // weights once their rows count (> 2·236), not on compute alone
    // (≤ 2·485).
    let cost = CostModel::swiglu_expert(2048, 768, 2, H200_LINK_BYTES_PER_S, H200_FLOPS_PER_S);
    let placed = |rule, cost: &CostModel| {
        let c = two_ranks(vec![vec![0, 0], vec![700, 0]]);
        let cfg = Config {
            replica_slots_per_rank: 1,
            replica_rule: rule,
            ..Config::default()
        };
        plan(&inputs(&c, cost), &cfg).unwrap().replicas_added.len()
    };
    assert_eq!(placed(ReplicaRule::Paying, &cost), 1);
    assert_eq!(placed(ReplicaRule::PayingCompute, &cost), 0);
    let no_rows = CostModel {
        exchange_row_bytes: 0,
        ..cost
    };
    assert_eq!(placed(ReplicaRule::Paying, &no_rows), 0);
    assert_eq!(placed(ReplicaRule::Fill, &cost), 1);
}

#[test]
fn huge_row_bytes_saturate_instead_of_overflowing() {
    let cost = CostModel {
        exchange_row_bytes: u64::MAX,
        ..cost()
    };
    let c = two_ranks(vec![vec![0, 0], vec![700, 0]]);
    let cfg = Config {
        replica_slots_per_rank: 1,
        ..Config::default()
    };
    let p = plan(&inputs(&c, &cost), &cfg).unwrap();
    assert!(modelled_call_seconds(&inputs(&c, &cost), &p.placement).is_finite());
}
