//! The controller against a real kube-apiserver (one per test, so controllers of different tests
//! never see each other's objects). No kubelet or external attacher runs: tests play both, by
//! writing node status (Ready, volumesInUse) and VolumeAttachment status themselves.

mod attach;
mod detach;
mod safety;
mod world;
