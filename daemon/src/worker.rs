//! What a worker process does with its node beyond serving: tensors pushed to it (`tb put`)
//! are published under their name, so the brokers point everyone else at it. Shared by
//! `tb-worker` and the workers `tb up` runs.

/// Publishes every tensor pushed to `node` under its name, until the node shuts down: what a
/// worker does with what `tb put` sends it.
pub async fn publish_pushes(node: tb_node::Node) {
    while let Ok(pushed) = node.recv().await {
        let name = pushed.name.as_str().to_string();
        match node.publish(&name, pushed.tensor).await {
            Ok(version) => tracing::info!(
                tensor = %name,
                version,
                from = %pushed.from.fmt_short(),
                "published a pushed tensor"
            ),
            Err(e) => tracing::warn!(tensor = %name, %e, "could not publish a pushed tensor"),
        }
    }
}
