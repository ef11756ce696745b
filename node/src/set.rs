//! [`TensorSet`]: many named tensors that travel as one version (a checkpoint, a state_dict).
//!
//! A set is published, announced, stored, fetched and retained as one tensor of dtype
//! [`DType::Set`] under its own name (the layout is [`tb_proto::set`]'s), so everything the
//! cluster does for a tensor it does for a set as a whole: a reader gets every member of one
//! version or an error, never a mix of two versions; retention keeps or evicts whole sets;
//! subscribers see one event per set version; every data channel carries it. The members of
//! a set that was received are slices of its one buffer: no copy.

use std::collections::BTreeMap;

use tb_proto::{DType, SetLayout, SetManifest, SetMember, TensorName};

use crate::{
    device::Device,
    error::{Error, Result},
    tensor::Tensor,
};

/// One version of a set: its members, in the order they were published, and its metadata.
#[derive(Debug, Clone)]
pub struct TensorSet {
    /// The set's name (its members are `name/key`).
    pub name: TensorName,
    /// The set's version.
    pub version: u64,
    /// Free-form string pairs (a safetensors file's `__metadata__`).
    pub metadata: BTreeMap<String, String>,
    /// `(key, tensor)` for every member, in publish order.
    pub members: Vec<(String, Tensor)>,
}

impl TensorSet {
    /// Lays `members` out as the bytes of the set `name` (checking the rules of
    /// [`SetLayout::new`]: unique keys that make valid names under `name`, at most
    /// [`tb_proto::MAX_SET_MEMBERS`] members, the whole under `max_bytes`) and returns them as
    /// one tensor of dtype [`DType::Set`], hashed. Copies every member once (a device member
    /// is copied to host memory first); blocks while it copies and hashes.
    pub fn pack(
        name: &TensorName,
        members: &[(String, Tensor)],
        metadata: BTreeMap<String, String>,
        max_bytes: u64,
    ) -> Result<Tensor> {
        // A member received as a loan by CUDA IPC (no hash yet) is hashed for the manifest.
        let members = (members.iter())
            .map(|(key, t)| Ok((key.clone(), t.clone().hashed()?)))
            .collect::<Result<Vec<_>>>()?;
        let manifest = SetManifest {
            members: members
                .iter()
                .map(|(key, t)| SetMember {
                    key: key.clone(),
                    dtype: t.dtype(),
                    shape: t.shape().to_vec(),
                    hash: t.hash(),
                })
                .collect(),
            metadata,
        };
        let layout = SetLayout::new(name, manifest, max_bytes).map_err(set_error(name))?;
        let len = usize::try_from(layout.len)
            .map_err(|_| Error::InvalidTensor(format!("set \"{name}\" does not fit in memory")))?;
        // Into the memory the set is served from (a memfd for large sets), zeroed between
        // members; then hashed on every core.
        let mut buf = crate::channel::HostBuf::new(len)?;
        let bytes = buf.as_mut();
        bytes[..layout.header.len()].copy_from_slice(&layout.header);
        for ((_, tensor), range) in members.iter().zip(&layout.ranges) {
            let dest = &mut bytes[range.start as usize..range.end as usize];
            match tensor.device() {
                Device::Host => dest.copy_from_slice(tensor.data()),
                Device::Cuda(_) => dest.copy_from_slice(tensor.to_device(Device::Host)?.data()),
            }
        }
        let hash = crate::channel::verify::hash_all(bytes);
        let meta = tb_proto::TensorMeta::new(DType::Set, vec![layout.len], hash)?;
        buf.into_tensor(meta)
    }

    /// Reads the set `name` at `version` from `tensor`, the set's verified bytes (as a get or
    /// a subscription delivers them). Fails with `InvalidTensor` when `tensor` is not a set
    /// (its dtype is not [`DType::Set`], it lives on a device, or its layout is invalid). The
    /// members are slices of `tensor`'s buffer; their hashes are the ones the manifest gives
    /// (covered by the set's hash, so they are its publisher's).
    pub fn from_tensor(name: TensorName, version: u64, tensor: &Tensor) -> Result<TensorSet> {
        if tensor.dtype() != DType::Set {
            return Err(Error::InvalidTensor(format!(
                "\"{name}\" is a {} tensor, not a set (get it as a tensor)",
                tensor.dtype()
            )));
        }
        let Some(bytes) = tensor.host_data() else {
            return Err(Error::InvalidTensor(format!(
                "set \"{name}\" is on a device; sets are read from host memory"
            )));
        };
        let layout = SetLayout::decode(&name, bytes).map_err(set_error(&name))?;
        let members = members_of(&layout, tensor)?;
        Ok(TensorSet {
            name,
            version,
            metadata: layout.manifest.metadata,
            members,
        })
    }

    /// The member `key`, if the set has it.
    pub fn get(&self, key: &str) -> Option<&Tensor> {
        self.members.iter().find(|(k, _)| k == key).map(|(_, t)| t)
    }

    /// Bytes of all members together (without the manifest and padding).
    pub fn members_bytes(&self) -> u64 {
        self.members.iter().map(|(_, t)| t.byte_len()).sum()
    }
}

/// Checks that a tensor about to be published as dtype [`DType::Set`] under `name` is a valid
/// set: a reader must never be handed one it cannot read.
pub(crate) fn check_publishable(name: &TensorName, tensor: &Tensor) -> Result<()> {
    if tensor.dtype() != DType::Set {
        return Ok(());
    }
    let Some(bytes) = tensor.host_data() else {
        return Err(Error::InvalidTensor(format!(
            "set \"{name}\" is on a device; a set is published from host memory"
        )));
    };
    SetLayout::decode(name, bytes).map_err(set_error(name))?;
    Ok(())
}

/// The members of `set` (whose bytes the layout was decoded from), each over its part of the
/// set's bytes (no copy; views of a member map its part of the set's memfd).
fn members_of(layout: &SetLayout, set: &Tensor) -> Result<Vec<(String, Tensor)>> {
    layout
        .members()
        .map(|(member, range)| {
            let meta = member.meta()?;
            let range = range.start as usize..range.end as usize;
            Ok((member.key.clone(), set.member(meta, range)))
        })
        .collect()
}

fn set_error(name: &TensorName) -> impl Fn(tb_proto::SetError) -> Error + '_ {
    move |e| Error::InvalidTensor(format!("set \"{name}\": {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> TensorName {
        TensorName::new(s).expect("name")
    }

    #[test]
    fn a_packed_set_reads_back_as_slices_of_one_buffer() {
        let a = Tensor::new(DType::F32, vec![3], vec![1u8; 12]).expect("valid");
        let b = Tensor::new(DType::BF16, vec![2, 2], vec![2u8; 8]).expect("valid");
        let s = Tensor::new(DType::I64, vec![], vec![3u8; 8]).expect("valid");
        let members = vec![("a".to_string(), a), ("l/b".into(), b), ("s".into(), s)];
        let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        let set = TensorSet::pack(&name("ck"), &members, metadata.clone(), 1 << 20).expect("valid");
        assert_eq!(set.dtype(), DType::Set);
        check_publishable(&name("ck"), &set).expect("valid");
        let back = TensorSet::from_tensor(name("ck"), 4, &set).expect("valid");
        assert_eq!(back.version, 4);
        assert_eq!(back.metadata, metadata);
        assert_eq!(back.members, members);
        assert_eq!(back.members_bytes(), 28);
        let base = set.data().as_ptr() as usize;
        for (_, t) in &back.members {
            let at = t.data().as_ptr() as usize - base;
            assert!(at < set.data().len());
            assert_eq!(at % 64, 0, "members are aligned and not copied");
        }
        assert_eq!(back.get("l/b"), Some(&members[1].1));
        assert!(back.get("x").is_none());
    }

    #[test]
    fn tensors_that_are_not_sets_are_refused() {
        let t = Tensor::new(DType::U8, vec![4], vec![0u8; 4]).expect("valid");
        let err = TensorSet::from_tensor(name("x"), 1, &t).expect_err("invalid");
        assert!(err.to_string().contains("not a set"), "{err}");
        let bogus = Tensor::new(DType::Set, vec![4], vec![0u8; 4]).expect("valid");
        let err = check_publishable(&name("x"), &bogus).expect_err("invalid");
        assert!(err.to_string().contains("set \"x\""), "{err}");
        let members = vec![("a b".to_string(), t)];
        let err =
            TensorSet::pack(&name("x"), &members, BTreeMap::new(), 1 << 20).expect_err("invalid");
        assert!(matches!(err, Error::InvalidTensor(_)), "{err}");
    }
}
