//! Over 600 lines: the replayed scenario table, one entry per upstream test case, kept whole so
//! it reads side by side with binder_test.go, delete_test.go and recycle_test.go.

use super::*;

/// The scenarios' initial objects, by upstream's id (binder_test.go TestSync, TestSyncBlockVolume,
/// TestMultiSync; delete_test.go; recycle_test.go).
pub(super) fn cases() -> Vec<Case> {
    let sel = "selected-node";
    vec![
        // [1] claims that do not name a volume
        case(
            "1-1 successful bind",
            vec![v("volume1-1", "1Gi", "", "", AV, RETAIN, "")],
            vec![c("claim1-1", "uid1-1", "1Gi", "", PE, None)],
        ),
        case(
            "1-2 noop",
            vec![v("volume1-2", "1Gi", "", "", AV, RETAIN, "")],
            vec![c("claim1-2", "uid1-2", "10Gi", "", PE, None)],
        ),
        case(
            "1-3 reset to Pending",
            vec![v("volume1-3", "1Gi", "", "", AV, RETAIN, "")],
            vec![c("claim1-3", "uid1-3", "10Gi", "", BO, None)],
        ),
        case(
            "1-4 smallest volume",
            vec![
                v("volume1-4-1", "10Gi", "", "", AV, RETAIN, ""),
                v("volume1-4-2", "1Gi", "", "", AV, RETAIN, ""),
            ],
            vec![c("claim1-4", "uid1-4", "1Gi", "", PE, None)],
        ),
        case(
            "1-5 prebound volume by name",
            vec![
                v("volume1-5-1", "10Gi", "", "claim1-5", AV, RETAIN, ""),
                v("volume1-5-2", "1Gi", "", "", AV, RETAIN, ""),
            ],
            vec![c("claim1-5", "uid1-5", "1Gi", "", PE, None)],
        ),
        case(
            "1-6 prebound volume by UID",
            vec![
                v("volume1-6-1", "10Gi", "uid1-6", "claim1-6", AV, RETAIN, ""),
                v("volume1-6-2", "1Gi", "", "", AV, RETAIN, ""),
            ],
            vec![c("claim1-6", "uid1-6", "1Gi", "", PE, None)],
        ),
        case(
            "1-7 prebound volume to different claim",
            vec![v("volume1-7", "10Gi", "uid1-777", "claim1-7", AV, RETAIN, "")],
            vec![c("claim1-7", "uid1-7", "1Gi", "", PE, None)],
        ),
        case(
            "1-8 complete bind after crash, PV bound",
            vec![v("volume1-8", "1Gi", "uid1-8", "claim1-8", AV, RETAIN, "").ann(BBC)],
            vec![c("claim1-8", "uid1-8", "1Gi", "", PE, None)],
        ),
        case(
            "1-9 complete bind after crash, PV status saved",
            vec![v("volume1-9", "1Gi", "uid1-9", "claim1-9", BO, RETAIN, "").ann(BBC)],
            vec![c("claim1-9", "uid1-9", "1Gi", "", PE, None)],
        ),
        case(
            "1-10 complete bind after crash, PVC bound",
            vec![v("volume1-10", "1Gi", "uid1-10", "claim1-10", BO, RETAIN, "").ann(BBC)],
            vec![
                c("claim1-10", "uid1-10", "1Gi", "volume1-10", PE, None)
                    .ann(BBC)
                    .ann(BC),
            ],
        ),
        case(
            "1-11 bind when selector matches",
            vec![v("volume1-1", "1Gi", "", "", AV, RETAIN, "").labelled()],
            vec![c("claim1-1", "uid1-1", "1Gi", "", PE, None).selector()],
        ),
        case(
            "1-12 do not bind when selector does not match",
            vec![v("volume1-1", "1Gi", "", "", AV, RETAIN, "")],
            vec![c("claim1-1", "uid1-1", "1Gi", "", PE, None).selector()],
        ),
        case(
            "1-13 delayed binding",
            vec![v("volume1-1", "1Gi", "", "", AV, RETAIN, "wait")],
            vec![c("claim1-1", "uid1-1", "1Gi", "", PE, WAIT)],
        ),
        case(
            "1-14 successful prebound PV",
            vec![v("volume1-1", "1Gi", "", "claim1-1", AV, RETAIN, "wait")],
            vec![c("claim1-1", "uid1-1", "1Gi", "", PE, WAIT)],
        ),
        case(
            "1-15 successful prebound PVC",
            vec![
                v("volume1-15-1", "10Gi", "", "", AV, RETAIN, ""),
                v("volume1-15-2", "1Gi", "", "", AV, RETAIN, ""),
            ],
            vec![c("claim1-15", "uid1-15", "1Gi", "volume1-15-1", PE, None)],
        ),
        case(
            "1-16 prebound PVC whose modes the volume lacks",
            vec![v("volume1-16", "1Gi", "", "", AV, RETAIN, "")],
            vec![c("claim1-16", "uid1-16", "1Gi", "volume1-16", PE, None).modes(&["ReadWriteMany"])],
        ),
        case(
            "1-17 skip non-available PV if it's not pre-bound",
            vec![
                v("volume1-17-pending", "1Gi", "", "", PE, RETAIN, ""),
                v("volume1-17-failed", "1Gi", "", "", "Failed", RETAIN, ""),
                v("volume1-17-released", "1Gi", "", "", "Released", RETAIN, ""),
                v("volume1-17-empty", "1Gi", "", "", "", RETAIN, ""),
            ],
            vec![c("claim1-17", "uid1-17", "1Gi", "", PE, None)],
        )
        .interchangeable(),
        case(
            "1-18 pre-bound PV to a delayed claim with a selected node",
            vec![v("volume1-18", "1Gi", "uid1-18", "claim1-18", AV, RETAIN, "wait")],
            vec![
                c("claim1-18", "uid1-18", "1Gi", "", PE, WAIT)
                    .ann(("volume.kubernetes.io/selected-node", "node1")),
            ],
        ),
        // provision_test.go 11-23: a selected node means the scheduler chose provisioning, so
        // the controller leaves a free volume alone (free volumes of a delayed claim are the
        // scheduler's to bind).
        case(
            "11-23 free volume skipped for a claim with a selected node",
            vec![v("volume11-23", "1Gi", "", "", AV, DELETE, "external-wait")],
            vec![
                c("claim11-23", "uid11-23", "1Gi", "", PE, Some("external-wait"))
                    .ann(("volume.kubernetes.io/selected-node", "node1")),
            ],
        ),
        // [2] claims that name a volume
        case(
            "2-1 claim prebound to non-existing volume",
            vec![],
            vec![c("claim2-1", "uid2-1", "10Gi", "volume2-1", PE, None)],
        ),
        case(
            "2-2 claim prebound to non-existing volume, reset status",
            vec![],
            vec![c("claim2-2", "uid2-2", "10Gi", "volume2-2", BO, None)],
        ),
        case(
            "2-3 claim prebound to unbound volume",
            vec![v("volume2-3", "1Gi", "", "", AV, RETAIN, "")],
            vec![c("claim2-3", "uid2-3", "1Gi", "volume2-3", PE, None)],
        ),
        case(
            "2-4 claim prebound to prebound volume by name",
            vec![v("volume2-4", "1Gi", "", "claim2-4", AV, RETAIN, "")],
            vec![c("claim2-4", "uid2-4", "1Gi", "volume2-4", PE, None)],
        ),
        case(
            "2-5 claim prebound to prebound volume by UID",
            vec![v("volume2-5", "1Gi", "uid2-5", "claim2-5", AV, RETAIN, "")],
            vec![c("claim2-5", "uid2-5", "1Gi", "volume2-5", PE, None)],
        ),
        case(
            "2-6 claim prebound to already bound volume",
            vec![v("volume2-6", "1Gi", "uid2-6_1", "claim2-6-1", BO, RETAIN, "")],
            vec![c("claim2-6", "uid2-6", "1Gi", "volume2-6", BO, None)],
        ),
        case(
            "2-7 claim bound by controller to already bound volume",
            vec![v("volume2-7", "1Gi", "uid2-7_1", "claim2-7-1", BO, RETAIN, "")],
            vec![c("claim2-7", "uid2-7", "1Gi", "volume2-7", BO, None).ann(BBC)],
        ),
        case(
            "2-8 claim prebound to volume that does not match the selector",
            vec![v("volume2-8", "1Gi", "", "", AV, RETAIN, "")],
            vec![c("claim2-8", "uid2-8", "1Gi", "volume2-8", PE, None).selector()],
        ),
        case(
            "2-9 claim prebound to a smaller volume",
            vec![v("volume2-9", "1Gi", "", "", AV, RETAIN, "")],
            vec![c("claim2-9", "uid2-9", "2Gi", "volume2-9", BO, None)],
        ),
        case(
            "2-10 claim prebound to volume of another class",
            vec![v("volume2-10", "1Gi", "1", "", AV, RETAIN, "gold")],
            vec![c("claim2-10", "uid2-10", "1Gi", "volume2-10", BO, None)],
        ),
        case(
            "2-11 claim prebound to volume of another attributes class",
            vec![
                v("volume2-11", "1Gi", "", "", AV, RETAIN, "")
                    .vac("gold")
                    .csi("vac.example.com"),
            ],
            vec![c("claim2-11", "uid2-11", "1Gi", "volume2-11", BO, None)],
        ),
        case(
            "2-12 claim prebound to volume of the same attributes class",
            vec![
                v("volume2-12", "1Gi", "", "", AV, RETAIN, "")
                    .vac("gold")
                    .csi("vac.example.com"),
            ],
            vec![c("claim2-12", "uid2-12", "1Gi", "volume2-12", PE, None).vac("gold")],
        ),
        case(
            "2-13 bound claim prebound to volume of the same attributes class",
            vec![
                v("volume2-13", "1Gi", "", "", AV, RETAIN, "")
                    .vac("gold")
                    .csi("vac.example.com"),
            ],
            vec![
                c("claim2-13", "uid2-13", "1Gi", "volume2-13", BO, None)
                    .vac("gold")
                    .status_vac("gold"),
            ],
        ),
        // [3] claims that were bound
        case(
            "3-1 bound claim with missing volumeName",
            vec![],
            vec![c("claim3-1", "uid3-1", "10Gi", "", BO, None).ann(BBC).ann(BC)],
        ),
        case(
            "3-2 bound claim with missing volume",
            vec![],
            vec![
                c("claim3-2", "uid3-2", "10Gi", "volume3-2", BO, None)
                    .ann(BBC)
                    .ann(BC),
            ],
        ),
        case(
            "3-3 bound claim with unbound volume",
            vec![v("volume3-3", "10Gi", "", "", AV, RETAIN, "")],
            vec![
                c("claim3-3", "uid3-3", "10Gi", "volume3-3", PE, None)
                    .ann(BBC)
                    .ann(BC),
            ],
        ),
        case(
            "3-4 bound claim with prebound volume",
            vec![v("volume3-4", "10Gi", "claim3-4-x", "claim3-4", AV, RETAIN, "")],
            vec![
                c("claim3-4", "uid3-4", "10Gi", "volume3-4", PE, None)
                    .ann(BBC)
                    .ann(BC),
            ],
        ),
        case(
            "3-5 bound claim with bound volume",
            vec![v("volume3-5", "10Gi", "uid3-5", "claim3-5", AV, RETAIN, "")],
            vec![c("claim3-5", "uid3-5", "10Gi", "volume3-5", PE, None).ann(BC)],
        ),
        case(
            "3-6 bound claim with volume bound elsewhere",
            vec![v("volume3-6", "10Gi", "uid3-6-x", "claim3-6-x", AV, RETAIN, "")],
            vec![c("claim3-6", "uid3-6", "10Gi", "volume3-6", PE, None).ann(BC)],
        ),
        case(
            "3-7 bound claim with unbound volume where selector doesn't match",
            vec![v("volume3-3", "10Gi", "", "", AV, RETAIN, "")],
            vec![
                c("claim3-3", "uid3-3", "10Gi", "volume3-3", PE, None)
                    .ann(BBC)
                    .ann(BC)
                    .selector(),
            ],
        ),
        // [4] volumes
        case(
            "4-1 pending volume",
            vec![v("volume4-1", "10Gi", "", "", PE, RETAIN, "")],
            vec![],
        ),
        case(
            "4-2 pending prebound volume",
            vec![v("volume4-2", "10Gi", "", "claim4-2", PE, RETAIN, "")],
            vec![],
        ),
        case(
            "4-3 bound volume with missing claim",
            vec![v("volume4-3", "10Gi", "uid4-3", "claim4-3", BO, RETAIN, "")],
            vec![],
        ),
        case(
            "4-4 volume bound to claim with different UID",
            vec![v("volume4-4", "10Gi", "uid4-4", "claim4-4", BO, RETAIN, "")],
            vec![c("claim4-4", "uid4-4-x", "10Gi", "volume4-4", BO, None).ann(BC)],
        ),
        case(
            "4-5 volume bound by controller to unbound claim",
            vec![v("volume4-5", "10Gi", "uid4-5", "claim4-5", BO, RETAIN, "").ann(BBC)],
            vec![c("claim4-5", "uid4-5", "10Gi", "", PE, None)],
        ),
        case(
            "4-5b volume bound by user to unbound claim",
            vec![v("volume4-5", "10Gi", "uid4-5", "claim4-5", BO, RETAIN, "")],
            vec![c("claim4-5", "uid4-5", "10Gi", "", PE, None)],
        ),
        case(
            "4-6 volume bound to bound claim",
            vec![v("volume4-6", "10Gi", "uid4-6", "claim4-6", AV, RETAIN, "")],
            vec![c("claim4-6", "uid4-6", "10Gi", "volume4-6", BO, None)],
        ),
        case(
            "4-7 volume bound by controller to claim bound somewhere else",
            vec![v("volume4-7", "10Gi", "uid4-7", "claim4-7", BO, RETAIN, "").ann(BBC)],
            vec![c("claim4-7", "uid4-7", "10Gi", "volume4-7-x", BO, None)],
        ),
        case(
            "4-8 volume bound by user to claim bound somewhere else",
            vec![v("volume4-8", "10Gi", "uid4-8", "claim4-8", BO, RETAIN, "")],
            vec![c("claim4-8", "uid4-8", "10Gi", "volume4-8-x", BO, None)],
        ),
        case(
            "4-9 volume bound to bound claim, policy Delete",
            vec![v("volume4-9", "10Gi", "uid4-9", "claim4-9", AV, DELETE, "")],
            vec![c("claim4-9", "uid4-9", "10Gi", "volume4-9", BO, None)],
        ),
        case(
            "4-10 volume bound to missing claim, policy Delete",
            vec![v("volume4-10", "10Gi", "uid4-10", "claim4-10", AV, DELETE, "")],
            vec![],
        ),
        // [13] classes
        case(
            "13-1 binding to class",
            vec![
                v("volume13-1-1", "1Gi", "", "", AV, RETAIN, ""),
                v("volume13-1-2", "10Gi", "", "", AV, RETAIN, "gold"),
            ],
            vec![c("claim13-1", "uid13-1", "1Gi", "", PE, GOLD)],
        ),
        case(
            "13-2 binding without a class",
            vec![
                v("volume13-2-1", "1Gi", "", "", AV, RETAIN, "gold"),
                v("volume13-2-2", "10Gi", "", "", AV, RETAIN, ""),
            ],
            vec![c("claim13-2", "uid13-2", "1Gi", "", PE, None)],
        ),
        case(
            "13-3 binding to a specific class",
            vec![
                v("volume13-3-1", "1Gi", "", "", AV, RETAIN, "silver"),
                v("volume13-3-2", "10Gi", "", "", AV, RETAIN, "gold"),
            ],
            vec![c("claim13-3", "uid13-3", "1Gi", "", PE, GOLD)],
        ),
        case(
            "13-4 empty class",
            vec![v("volume13-4", "1Gi", "", "", AV, RETAIN, "")],
            vec![c("claim13-4", "uid13-4", "1Gi", "", PE, Some(""))],
        ),
        case(
            "13-5 nil class",
            vec![v("volume13-5", "1Gi", "", "", AV, RETAIN, "")],
            vec![c("claim13-5", "uid13-5", "1Gi", "", PE, None)],
        ),
        // [14] volume modes
        case(
            "14-1 block to block",
            vec![v("volume14-1", "10Gi", "", "", AV, RETAIN, "").block()],
            vec![c("claim14-1", "uid14-1", "10Gi", "", PE, None).block()],
        ),
        case(
            "14-2 filesystem to filesystem",
            vec![v("volume14-2", "10Gi", "", "", AV, RETAIN, "")],
            vec![c("claim14-2", "uid14-2", "10Gi", "", PE, None)],
        ),
        case(
            "14-3 filesystem volume, block claim",
            vec![v("volume14-3", "10Gi", "", "", AV, RETAIN, "")],
            vec![c("claim14-3", "uid14-3", "10Gi", "", PE, None).block()],
        ),
        case(
            "14-4 block volume, filesystem claim",
            vec![v("volume14-4", "10Gi", "", "", AV, RETAIN, "").block()],
            vec![c("claim14-4", "uid14-4", "10Gi", "", PE, None)],
        ),
        case(
            "14-5 class matches, mode does not",
            vec![v("volume14-5", "10Gi", "", "", AV, RETAIN, "gold")],
            vec![c("claim14-5", "uid14-5", "10Gi", "", PE, GOLD).block()],
        ),
        case(
            "14-5-1 mode matches, class does not",
            vec![v("volume14-5-1", "10Gi", "", "", AV, RETAIN, "gold")],
            vec![c("claim14-5-1", "uid14-5-1", "10Gi", "", PE, Some("silver"))],
        ),
        case(
            "14-5-2 prebound claim, mode matches, class does not",
            vec![v("volume14-5-2", "10Gi", "", "", AV, RETAIN, "gold")],
            vec![c(
                "claim14-5-2",
                "uid14-5-2",
                "10Gi",
                "volume14-5-2",
                PE,
                Some("silver"),
            )],
        ),
        case(
            "14-7 prebound volume, modes match",
            vec![v("volume14-7", "10Gi", "", "claim14-7", AV, RETAIN, "").block()],
            vec![c("claim14-7", "uid14-7", "10Gi", "", PE, None).block()],
        ),
        case(
            "14-8 prebound claim, modes differ",
            vec![v("volume14-8", "10Gi", "", "", AV, RETAIN, "").block()],
            vec![c("claim14-8", "uid14-8", "10Gi", "volume14-8", PE, None)],
        ),
        case(
            "14-8-1 prebound volume, modes differ",
            vec![v("volume14-8-1", "10Gi", "", "claim14-8-1", AV, RETAIN, "").block()],
            vec![c("claim14-8-1", "uid14-8-1", "10Gi", "", PE, None)],
        ),
        case(
            "14-9 prebound claim, block",
            vec![v("volume14-9", "10Gi", "", "", AV, RETAIN, "").block()],
            vec![c("claim14-9", "uid14-9", "10Gi", "volume14-9", PE, None).block()],
        ),
        case(
            "14-10 prebound volume, block",
            vec![v("volume14-10", "10Gi", "", "claim14-10", AV, RETAIN, "").block()],
            vec![c("claim14-10", "uid14-10", "10Gi", "", PE, None).block()],
        ),
        case(
            "14-11 prebound claim, filesystem",
            vec![v("volume14-11", "10Gi", "", "", AV, RETAIN, "")],
            vec![c("claim14-11", "uid14-11", "10Gi", "volume14-11", PE, None)],
        ),
        case(
            "14-12 prebound volume, filesystem",
            vec![v("volume14-12", "10Gi", "", "claim14-12", AV, RETAIN, "")],
            vec![c("claim14-12", "uid14-12", "10Gi", "", PE, None)],
        ),
        case(
            "14-13 volume bound by controller, modes differ (file/block)",
            vec![v("volume14-13", "10Gi", "uid14-13", "claim14-13", AV, RETAIN, "").ann(BBC)],
            vec![c("claim14-13", "uid14-13", "10Gi", "", PE, None).block()],
        ),
        case(
            "14-13-1 volume bound by controller, modes differ (block/file)",
            vec![
                v(
                    "volume14-13-1",
                    "10Gi",
                    "uid14-13-1",
                    "claim14-13-1",
                    AV,
                    RETAIN,
                    "",
                )
                .ann(BBC)
                .block(),
            ],
            vec![c("claim14-13-1", "uid14-13-1", "10Gi", "", PE, None)],
        ),
        case(
            "14-14 volume bound by controller, block",
            vec![
                v("volume14-14", "10Gi", "uid14-14", "claim14-14", AV, RETAIN, "")
                    .ann(BBC)
                    .block(),
            ],
            vec![c("claim14-14", "uid14-14", "10Gi", "", PE, None).block()],
        ),
        case(
            "14-14-1 volume bound by controller, filesystem",
            vec![
                v(
                    "volume14-14-1",
                    "10Gi",
                    "uid14-14-1",
                    "claim14-14-1",
                    AV,
                    RETAIN,
                    "",
                )
                .ann(BBC),
            ],
            vec![c("claim14-14-1", "uid14-14-1", "10Gi", "", PE, None)],
        ),
        // [10] multi-sync
        case(
            "10-1 successful bind",
            vec![v("volume10-1", "1Gi", "", "", PE, RETAIN, "")],
            vec![c("claim10-1", "uid10-1", "1Gi", "", PE, None)],
        ),
        case(
            "10-2 bind PV race",
            vec![
                v("volume10-2-1", "1Gi", "uid10-2", "claim10-2", BO, RETAIN, "").ann(BBC),
                v("volume10-2-2", "1Gi", "uid10-2", "claim10-2", BO, RETAIN, "").ann(BBC),
            ],
            vec![
                c("claim10-2", "uid10-2", "1Gi", "volume10-2-1", BO, None)
                    .ann(BBC)
                    .ann(BC),
            ],
        ),
        // [8] delete (no deleter plugin on either side)
        case(
            "8-1 delete, no deleter",
            vec![v("volume8-1", "1Gi", "uid8-1", "claim8-1", BO, DELETE, "").ann(BBC)],
            vec![],
        ),
        case(
            "8-2 delete prebound volume, no deleter",
            vec![v("volume8-2", "1Gi", "uid8-2", "claim8-2", BO, DELETE, "")],
            vec![],
        ),
        case(
            "8-3 plugin not found",
            vec![v("volume8-3", "1Gi", "uid8-3", "claim8-3", BO, DELETE, "").ann(DYN)],
            vec![],
        ),
        case(
            "8-9 prebound volume deleted while a claim of that name exists",
            vec![v("volume8-9", "1Gi", "uid8-9", "claim8-9", BO, DELETE, "")],
            vec![c("claim8-9", "uid8-9-x", "10Gi", "", PE, None)],
        ),
        case(
            "8-10-1 external deleter, dynamically provisioned",
            vec![
                v("volume8-10-1", "1Gi", "uid10-1-1", "claim10-1-1", BO, DELETE, "")
                    .ann(BBC)
                    .ann(("pv.kubernetes.io/provisioned-by", "external.io/test"))
                    .csi("pd.csi.storage.gke.io"),
            ],
            vec![],
        ),
        case(
            "8-10-2 external deleter, statically provisioned",
            vec![
                v("volume8-10-2", "1Gi", "uid10-1-2", "claim10-1-2", BO, DELETE, "")
                    .ann(BBC)
                    .csi("pd.csi.storage.gke.io"),
            ],
            vec![],
        ),
        case(
            "8-10-3 external deleter, migrated",
            vec![
                v("volume8-10-3", "1Gi", "uid10-1-3", "claim10-1-3", BO, DELETE, "")
                    .ann(("pv.kubernetes.io/provisioned-by", "kubernetes.io/gce-pd"))
                    .ann(("pv.kubernetes.io/migrated-to", "pd.csi.storage.gke.io")),
            ],
            vec![],
        ),
        case(
            "8-11 two PVs provisioned for a single claim",
            vec![
                v("volume8-11-1", "1Gi", "uid8-11", "claim8-11", BO, DELETE, "").ann(DYN),
                v("volume8-11-2", "1Gi", "uid8-11", "claim8-11", BO, DELETE, "").ann(DYN),
            ],
            vec![c("claim8-11", "uid8-11", "10Gi", "volume8-11-2", BO, None)],
        ),
        case(
            "8-12 two PVs externally provisioned for a single claim",
            vec![
                v("volume8-12-1", "1Gi", "uid8-12", "claim8-12", BO, DELETE, "")
                    .ann(("pv.kubernetes.io/provisioned-by", "pd.csi.storage.gke.io"))
                    .csi("pd.csi.storage.gke.io"),
                v("volume8-12-2", "1Gi", "uid8-12", "claim8-12", BO, DELETE, "")
                    .ann(("pv.kubernetes.io/provisioned-by", "pd.csi.storage.gke.io"))
                    .csi("pd.csi.storage.gke.io"),
            ],
            vec![c("claim8-12", "uid8-12", "10Gi", "volume8-12-2", BO, None)],
        ),
        case(
            "8-13 in-tree protected volume of a deleted claim",
            vec![
                v("volume8-13", "1Gi", "uid8-13", "claim8-13", BO, DELETE, "")
                    .ann(BBC)
                    .finalizer("kubernetes.io/pv-controller"),
            ],
            vec![],
        ),
        // [6] recycle (no recycler plugin on either side)
        case(
            "6-1 recycle, no recycler",
            vec![v("volume6-1", "1Gi", "uid6-1", "claim6-1", BO, RECYCLE, "").ann(BBC)],
            vec![],
        ),
        case(
            "6-2 recycle prebound volume, no recycler",
            vec![v("volume6-2", "1Gi", "uid6-2", "claim6-2", BO, RECYCLE, "")],
            vec![],
        ),
        case(
            "6-9 prebound volume recycled while a claim of that name exists",
            vec![v("volume6-9", "1Gi", "uid6-9", "claim6-9", BO, RECYCLE, "")],
            vec![c("claim6-9", "uid6-9-x", "10Gi", "", PE, None)],
        ),
        Case {
            interchangeable: false,
            id: "6-11 used by running pod",
            vols: vec![v("volume6-11", "1Gi", "uid6-11", "running-claim", BO, RECYCLE, "").ann(BBC)],
            claims: vec![],
            pods: vec![PodUse {
                name: "running-pod",
                claim: "running-claim",
                phase: "Running",
            }],
        },
        Case {
            interchangeable: false,
            id: "6-12 used by pending pod",
            vols: vec![v("volume6-12", "1Gi", "uid6-12", "pending-claim", BO, RECYCLE, "").ann(BBC)],
            claims: vec![],
            pods: vec![PodUse {
                name: "pending-pod",
                claim: "pending-claim",
                phase: "Pending",
            }],
        },
        Case {
            interchangeable: false,
            id: "6-13 used by completed pod",
            vols: vec![v("volume6-13", "1Gi", "uid6-13", "completed-claim", BO, RECYCLE, "").ann(BBC)],
            claims: vec![],
            pods: vec![PodUse {
                name: "completed-pod",
                claim: "completed-claim",
                phase: "Succeeded",
            }],
        },
        Case {
            interchangeable: false,
            id: "6-14 seemingly used by running pod",
            vols: vec![v("volume6-14", "1Gi", "uid6-14", "completed-claim", BO, RECYCLE, "").ann(BBC)],
            claims: vec![c("completed-claim", "uid6-14-x", "10Gi", "", BO, None)],
            pods: vec![PodUse {
                name: "running-pod",
                claim: "completed-claim",
                phase: "Running",
            }],
        },
    ]
    .into_iter()
    .map(|mut k| {
        // `sel` documents the one scenario that needs a node name; nodes are not created.
        let _ = sel;
        k.claims.sort_by_key(|c| c.name);
        k
    })
    .collect()
}
