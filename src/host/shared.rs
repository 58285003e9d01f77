//! `Store` over proxy-wasm shared data (one map per `vm_id`, shared by
//! every VM in the Envoy process).

use super::abi;
use crate::store::{Store, StoreError};

pub struct SharedData;

impl Store for SharedData {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        // A failed read looks like an absent key: every record is
        // optional. (A write after it is unconditional, as on any absent
        // key; records claimed by CAS are only ever claimed from a read
        // that returned a CAS, see `store::get_existing`.)
        abi::get_shared_data(key).unwrap_or((None, None))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        match abi::set_shared_data(key, value, cas.unwrap_or(0)) {
            Ok(()) => Ok(()),
            Err(abi::CAS_MISMATCH) => Err(StoreError::CasMismatch),
            Err(status) => Err(StoreError::Host(format!("status {status}"))),
        }
    }
}
