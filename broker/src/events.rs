//! What subscribers hear: the [`Event`] a registry change produces ([`event_for`]) and the
//! subscriptions it goes to ([`matching`]).

use tb_proto::{Entry, Event, NamePattern, TensorName};

/// The event a change to `name` produces, given the newest version that was live before it
/// (`None`: the name was unknown, unpublished or deleted) and the entry after it if live.
///
/// A head that moved forward (or a name that came back to life) is `Published`, with the
/// newest version only: a subscriber that missed intermediate versions gets the latest. A live
/// name that stopped being live was deleted. Anything else (a holder mark, a lost race) says
/// nothing.
pub fn event_for(name: &TensorName, before: Option<u64>, after: Option<&Entry>) -> Option<Event> {
    match (before, after) {
        (_, Some(e)) if before.is_none_or(|v| e.version > v) => Some(Event::Published {
            name: name.clone(),
            version: e.version,
            meta: e.meta.clone(),
            publisher: e.publisher,
        }),
        (Some(_), None) => Some(Event::Deleted { name: name.clone() }),
        _ => None,
    }
}

/// The keys of the subscriptions (key, pattern) whose pattern matches `event`'s name.
pub fn matching<'a, K: 'a>(
    subscriptions: impl IntoIterator<Item = (K, &'a NamePattern)> + 'a,
    event: &'a Event,
) -> impl Iterator<Item = K> + 'a {
    let name = event.name();
    subscriptions
        .into_iter()
        .filter(move |(_, pattern)| pattern.matches(name))
        .map(|(key, _)| key)
}

#[cfg(test)]
mod tests {
    use tb_proto::{ContentHash, DType, NodeId, RegistryOp, Stamp, TensorMeta};

    use super::*;

    fn name(s: &str) -> TensorName {
        TensorName::new(s).expect("name")
    }

    fn entry(version: u64) -> Entry {
        let mut r = tb_proto::Registry::new();
        let meta = TensorMeta::new(DType::U8, vec![4], ContentHash([version as u8; 32]));
        r.apply(&RegistryOp::Publish {
            name: name("m/w"),
            version,
            meta: meta.expect("meta"),
            publisher: NodeId([1; 32]),
            stamp: Stamp {
                wall_ms: version,
                logical: 0,
                node: NodeId([1; 32]),
            },
        });
        r.entry(&name("m/w")).expect("live").clone()
    }

    #[test]
    fn only_forward_heads_and_deletes_make_events() {
        let n = name("m/w");
        let v2 = entry(2);
        match event_for(&n, Some(1), Some(&v2)) {
            Some(Event::Published { version: 2, .. }) => {}
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            event_for(&n, None, Some(&v2)),
            Some(Event::Published { version: 2, .. })
        ));
        assert_eq!(event_for(&n, Some(2), Some(&v2)), None);
        assert_eq!(event_for(&n, Some(3), Some(&v2)), None);
        assert_eq!(
            event_for(&n, Some(2), None),
            Some(Event::Deleted { name: n.clone() })
        );
        assert_eq!(event_for(&n, None, None), None);
    }

    #[test]
    fn events_go_to_matching_patterns() {
        let subs: Vec<(u32, NamePattern)> = ["m/*", "m/w", "m/x", "*", "n/*"]
            .iter()
            .zip(0..)
            .map(|(p, k)| (k, p.parse().expect("pattern")))
            .collect();
        let event = Event::Deleted { name: name("m/w") };
        let hit: Vec<u32> = matching(subs.iter().map(|(k, p)| (*k, p)), &event).collect();
        assert_eq!(hit, [0, 1, 3]);
    }
}
