//! The apiserver client: transport, rate limits, client metrics, write helpers, and the wire
//! forms the client decodes into (`lean`, `volumeattachment`).

/// A stored form is addressed as its API type (same kind, group, URL; kube's stores and `Api`
/// accept it) and its metadata is the field at `$meta` (for example `metadata`, `0.metadata`).
macro_rules! addressed_as {
    ($ty:ty, $api:ty, $($meta:tt)+) => {
        impl k8s_openapi::Resource for $ty {
            const API_VERSION: &'static str = <$api as k8s_openapi::Resource>::API_VERSION;
            const GROUP: &'static str = <$api as k8s_openapi::Resource>::GROUP;
            const KIND: &'static str = <$api as k8s_openapi::Resource>::KIND;
            const VERSION: &'static str = <$api as k8s_openapi::Resource>::VERSION;
            const URL_PATH_SEGMENT: &'static str = <$api as k8s_openapi::Resource>::URL_PATH_SEGMENT;
            type Scope = <$api as k8s_openapi::Resource>::Scope;
        }

        impl k8s_openapi::Metadata for $ty {
            type Ty = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

            fn metadata(&self) -> &Self::Ty {
                &self.$($meta)+
            }

            fn metadata_mut(&mut self) -> &mut Self::Ty {
                &mut self.$($meta)+
            }
        }
    };
}
pub(crate) use addressed_as;

pub mod attachments;
pub mod client;
pub mod clientmetrics;
pub mod identity;
pub(crate) mod lean;
pub mod ratelimit;
pub mod transport;
pub mod volumeattachment;
pub mod writes;
