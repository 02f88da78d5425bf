//! The `local` backend in one process with the real model: a prefill engine streams each
//! step's full pages into pages a decode engine reserved, through `KvTransport`, and the
//! decode engine's output equals the colocated engine's, greedy and seeded.

use std::path::PathBuf;

use duet_engine::sampling::Sampled;
use duet_engine::scheduler::Resume;
use duet_engine::{Engine, EngineOptions, Model, Runner, SamplingParams};
use duet_fetch as fetch;
use duet_gpu::KvDtype;
use duet_transport::{
    Backend, ClaimTable, Endpoint, Grants, LocalRegistration, Revocation, coalesce, connect,
    unwatched,
};

const PAGE: usize = 16;
const CHUNK: usize = 32;

fn runner(model: &std::path::Path) -> Runner {
    let engine = Engine::new(
        Model::open(model).expect("model"),
        EngineOptions {
            kv_dtype: KvDtype::F16,
            page_size: PAGE,
            kv_pages: 32,
            threads: 1,
            max_context: 2048,
        },
    )
    .expect("engine");
    Runner::new(engine, CHUNK, 8)
}

/// Prefill on `p`, stream pages into `d`'s reserved pages, decode on `d`.
fn disaggregated(
    p: &mut Runner,
    d: &mut Runner,
    prompt: &[u32],
    params: &SamplingParams,
) -> String {
    let reg = LocalRegistration::new(d.engine.pool.memory());
    // Decode's grants: the local writer copies each run under a claim decode can revoke.
    let claims = format!("local-transfer-{}-{}", std::process::id(), prompt.len());
    let grants = Grants::with_claims(ClaimTable::create(&claims, 32).expect("claim table"));
    let endpoint = Endpoint {
        host: duet_transport::host_id(),
        local: Some(reg.key()),
        shm: None,
        claims: Some(claims),
        tcp: None,
    };
    let mut t = connect(&endpoint, Backend::Local).expect("connect");
    let dst = d
        .engine
        .pool
        .alloc
        .alloc(prompt.len().div_ceil(PAGE))
        .expect("pages");
    let grant = grants.grant(1, d.engine.pool.layout(), &dst);
    p.scheduler
        .submit_prefill(1, prompt.to_vec(), params.clone(), Resume::default())
        .expect("submit");
    let mut sent = 0;
    loop {
        let plan = p
            .scheduler
            .plan(&mut p.engine.pool.alloc, &mut p.cache)
            .expect("plan");
        let logits = p.engine.step(&p.scheduler.chunks(&plan)).expect("step");
        let it = &plan.items[0];
        let upto = if it.sample {
            (it.start + it.len).div_ceil(PAGE)
        } else {
            (it.start + it.len) / PAGE
        };
        let src = &p.scheduler.pages(1).expect("pages")[sent..upto];
        let runs = coalesce(src.iter().copied().zip(dst[sent..upto].iter().copied()));
        let layout = *p.engine.pool.layout();
        t.write(
            grant,
            &p.engine.pool.memory(),
            &layout,
            &runs,
            &mut unwatched,
        )
        .expect("write");
        sent = upto;
        let events = p
            .scheduler
            .commit(
                &plan,
                &logits,
                &p.engine.model.tokenizer,
                &mut p.engine.pool.alloc,
                &mut p.cache,
            )
            .expect("commit");
        if let Some(ev) = events.into_iter().find(|e| e.handoff.is_some()) {
            t.fence(1).expect("fence");
            assert_eq!(grants.revoke(1), Revocation::Proven);
            let first = d
                .scheduler
                .admit_transferred(
                    7,
                    prompt.to_vec(),
                    params.clone(),
                    Resume::default(),
                    ev.handoff.expect("handoff"),
                    dst,
                    Sampled {
                        token: ev.token,
                        logprob: ev.logprob,
                        top: ev.top.clone(),
                    },
                    0,
                    &d.engine.model.tokenizer,
                    &mut d.engine.pool.alloc,
                    &mut d.cache,
                )
                .expect("admit");
            let rest = d.run_to_completion().expect("decode");
            return std::iter::once(first.text)
                .chain(rest.into_iter().map(|e| e.text))
                .collect();
        }
    }
}

#[test]
fn local_backend_output_equals_colocated() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("models")
        .join(fetch::MODEL_FILE);
    let path = fetch::ensure_model(&path, &mut |_| {}).expect("the real model");
    let (mut colo, mut p, mut d) = (runner(&path), runner(&path), runner(&path));
    let text = "Paged attention keeps the KV cache in fixed-size pages, so sequences grow without \
                copying and pages can move between machines as plain bytes. "
        .repeat(4);
    let ids = colo.engine.model.tokenizer.encode(&text);
    let greedy = SamplingParams {
        max_tokens: 8,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let seeded = SamplingParams {
        temperature: 0.9,
        seed: Some(5),
        ..greedy.clone()
    };
    for n in [1, PAGE - 1, PAGE, PAGE + 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5] {
        for params in [&greedy, &seeded] {
            colo.submit(1, ids[..n].to_vec(), params.clone())
                .expect("submit");
            let want: String = colo
                .run_to_completion()
                .expect("run")
                .into_iter()
                .map(|e| e.text)
                .collect();
            let got = disaggregated(&mut p, &mut d, &ids[..n], params);
            assert_eq!(got, want, "{n} tokens, temperature {}", params.temperature);
        }
    }
    // Both pools are whole: every page free or held only by the prefix cache.
    for r in [&p, &d] {
        let s = r.engine.pool.alloc.stats();
        assert_eq!(s.pinned, 0);
        assert_eq!(s.free + r.cache.evictable(&r.engine.pool.alloc), s.capacity);
    }
}
