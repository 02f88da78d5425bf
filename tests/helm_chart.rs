//! The Kubernetes chart under `deploy/helm/duet`, checked with a real Helm (built with `go`,
//! pinned by `tools/helm/go.sum`, cached): `helm lint` passes, and what `helm template` renders
//! fits the code: the cluster.toml in its ConfigMap loads with Duet's own loader and names one
//! node per pod, at the DNS name its headless Service gives it, on the port its container
//! opens; the probes and the drain hook call routes and commands that exist, with the file and
//! credentials where the pods mount them.

use std::path::{Path, PathBuf};
use std::process::Command;

use duet_runtime::config::{ClusterConfig, Role};
use serde::Deserialize;
use serde_yaml::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The pinned Helm, built once.
fn helm() -> PathBuf {
    let out = Command::new(root().join("tools/helm/install.sh"))
        .output()
        .expect("tools/helm/install.sh (needs go)");
    assert!(
        out.status.success(),
        "building Helm: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

fn chart() -> PathBuf {
    root().join("deploy/helm/duet")
}

/// `helm template` with `sets`, as one YAML value per object.
fn render(helm: &Path, sets: &[&str]) -> Vec<Value> {
    let mut cmd = Command::new(helm);
    cmd.args(["template", "demo"]).arg(chart());
    cmd.args(["--namespace", "serving"]);
    for s in sets {
        cmd.args(["--set", s]);
    }
    let out = cmd.output().expect("helm template");
    assert!(
        out.status.success(),
        "helm template: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    serde_yaml::Deserializer::from_str(&text)
        .filter_map(|d| Value::deserialize(d).ok())
        .filter(|v| !v.is_null())
        .collect()
}

fn of_kind<'a>(objects: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objects.iter().filter(|o| o["kind"] == kind).collect()
}

fn str_of(v: &Value) -> &str {
    v.as_str().unwrap_or_default()
}

#[test]
fn helm_lint_passes() {
    let out = Command::new(helm())
        .arg("lint")
        .arg(chart())
        .output()
        .expect("helm lint");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_rendered_manifests_fit_the_code() {
    let helm = helm();
    let objects = render(&helm, &["roles.decode.replicas=3", "drainSeconds=45"]);
    let dir = tempfile::tempdir().expect("tempdir");

    // The ConfigMap's cluster.toml loads with Duet's loader.
    let maps = of_kind(&objects, "ConfigMap");
    let toml = str_of(&maps[0]["data"]["cluster.toml"]);
    let path = dir.path().join("cluster.toml");
    std::fs::write(&path, toml).expect("write cluster.toml");
    let config = ClusterConfig::load(&path).unwrap_or_else(|e| panic!("{e}\n{toml}"));
    let roles: Vec<Role> = config.nodes.iter().map(|n| n.role).collect();
    assert_eq!(
        roles,
        [
            Role::Router,
            Role::Prefill,
            Role::Decode,
            Role::Decode,
            Role::Decode
        ]
    );
    let serving = duet_actors::settings::ServingConfig::for_node(&config, &config.nodes[0].name)
        .expect("the serving section loads");
    assert_eq!(serving.shutdown_drain.as_secs(), 45);

    let sets = of_kind(&objects, "StatefulSet");
    let services = of_kind(&objects, "Service");
    assert_eq!(sets.len(), 3);
    for set in &sets {
        let name = str_of(&set["metadata"]["name"]);
        let replicas = set["spec"]["replicas"].as_u64().expect("replicas");
        let service_name = str_of(&set["spec"]["serviceName"]);
        let service = services
            .iter()
            .find(|s| s["metadata"]["name"] == service_name)
            .expect("the StatefulSet's Service");
        assert_eq!(service["spec"]["clusterIP"], "None", "headless");
        assert_eq!(service["spec"]["publishNotReadyAddresses"], true);
        let link_port = service["spec"]["ports"][0]["port"].as_u64().expect("port");
        assert_eq!(service["spec"]["ports"][0]["protocol"], "UDP");
        let pod = &set["spec"]["template"]["spec"];
        let c = &pod["containers"][0];
        // One [[node]] per pod, at the pod's DNS name, on the port the container opens.
        for i in 0..replicas {
            let pod_name = format!("{name}-{i}");
            let node = config
                .node(&pod_name)
                .unwrap_or_else(|| panic!("no node {pod_name} in\n{toml}"));
            assert_eq!(
                node.dial.as_deref(),
                Some(
                    format!("{pod_name}.{service_name}.serving.svc.cluster.local:{link_port}")
                        .as_str()
                )
            );
            assert!(node.admin.ip().is_loopback(), "admin stays inside the pod");
        }
        let ports: Vec<(String, u64)> = c["ports"]
            .as_sequence()
            .expect("ports")
            .iter()
            .map(|p| {
                (
                    str_of(&p["name"]).to_string(),
                    p["containerPort"].as_u64().unwrap_or(0),
                )
            })
            .collect();
        assert!(
            ports.contains(&("link".to_string(), link_port)),
            "{ports:?}"
        );
        // The command starts the pod as its node, bound to its own IP on the link port.
        let command: Vec<&str> = c["command"]
            .as_sequence()
            .expect("command")
            .iter()
            .map(str_of)
            .collect();
        assert_eq!(
            command,
            [
                "duet",
                "node",
                "--config",
                "/etc/duet/cluster.toml",
                "--name",
                "$(POD_NAME)",
                "--address",
                &format!("$(POD_IP):{link_port}"),
            ]
        );
        // The file and the credentials are where the command and cluster.toml say.
        let mounts = c["volumeMounts"].as_sequence().expect("mounts");
        let mount = |name: &str| {
            mounts
                .iter()
                .find(|m| m["name"] == name)
                .map(|m| str_of(&m["mountPath"]).to_string())
        };
        assert_eq!(mount("config").as_deref(), Some("/etc/duet/cluster.toml"));
        assert_eq!(
            mount("credentials").as_deref(),
            config.credentials.cert.parent().and_then(|p| p.to_str())
        );
        // The drain hook drains this node and waits as long as the drain may take; the pod
        // gets longer than that to stop.
        let pre_stop = str_of(&c["lifecycle"]["preStop"]["exec"]["command"][2]);
        assert_eq!(
            pre_stop,
            "duet drain --config /etc/duet/cluster.toml \"$POD_NAME\" --wait 45"
        );
        let grace = pod["terminationGracePeriodSeconds"]
            .as_u64()
            .expect("grace");
        assert!(grace > 45, "{grace}");
        // Probes: a router's /ready on its HTTP port; a worker's `duet status`.
        let ready = &c["readinessProbe"];
        if name.ends_with("-router") {
            assert_eq!(ready["httpGet"]["path"], "/ready");
            assert_eq!(ready["httpGet"]["port"], "http");
            let http = ports.iter().find(|(n, _)| n == "http").expect("http port");
            assert_eq!(http.1, u64::from(serving.http.port()));
            let annotations = &set["spec"]["template"]["metadata"]["annotations"];
            assert_eq!(annotations["prometheus.io/scrape"], "true");
            assert_eq!(annotations["prometheus.io/path"], "/metrics");
        } else {
            assert_eq!(
                str_of(&ready["exec"]["command"][2]),
                "duet status --config /etc/duet/cluster.toml \"$POD_NAME\""
            );
        }
    }
    // The routes and commands the manifests call exist.
    let router =
        std::fs::read_to_string(root().join("actors/src/router/http.rs")).expect("http.rs");
    for route in ["\"/ready\"", "\"/metrics\""] {
        assert!(router.contains(&format!(".route({route}")), "{route}");
    }
    for args in [["status", "--help"], ["drain", "--help"]] {
        let out = Command::new(env!("CARGO_BIN_EXE_duet"))
            .args(args)
            .output()
            .expect("duet");
        assert!(out.status.success(), "duet {args:?}");
    }
    // The API Service reaches the routers' HTTP port.
    let api = services
        .iter()
        .find(|s| s["metadata"]["name"] == "demo-duet")
        .expect("the API Service");
    assert_eq!(api["spec"]["ports"][0]["targetPort"], "http");
    assert_eq!(
        api["spec"]["selector"]["app.kubernetes.io/component"],
        "router"
    );
}
