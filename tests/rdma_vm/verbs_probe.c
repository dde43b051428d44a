/*
 * verbs_probe: proves that a verbs binary built on the host runs in the
 * Soft-RoCE guest. Opens the device, queries port 1 and the GID, registers
 * two 1 MiB buffers, connects two RC QPs to each other through the device's
 * own (IPv4-mapped, RoCE v2) GID, does one 1 MiB RDMA WRITE and verifies it.
 *
 * Device and GID index come from MORI_RDMA_DEVICE / MORI_RDMA_GID_INDEX
 * (set by run_in_vm.sh), defaulting to rxe0 / 1.
 * Build: gcc -O2 -o verbs_probe verbs_probe.c -libverbs  (no -march=native:
 * the emulated CPU lacks the host's AVX-512).
 */
#include <infiniband/verbs.h>

#include <arpa/inet.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define BUF_SIZE (1u << 20)
#define PORT 1

static void die(const char *what, int err)
{
    fprintf(stderr, "verbs_probe: FAILED: %s: %s\n", what, strerror(err));
    exit(1);
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static struct ibv_qp *make_qp(struct ibv_pd *pd, struct ibv_cq *cq)
{
    struct ibv_qp_init_attr ia = {
        .send_cq = cq,
        .recv_cq = cq,
        .cap = {.max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1},
        .qp_type = IBV_QPT_RC,
    };
    struct ibv_qp *qp = ibv_create_qp(pd, &ia);
    if (!qp)
        die("ibv_create_qp", errno);
    struct ibv_qp_attr a = {
        .qp_state = IBV_QPS_INIT,
        .pkey_index = 0,
        .port_num = PORT,
        .qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ,
    };
    int rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
    if (rc)
        die("modify_qp INIT", rc);
    return qp;
}

/* INIT -> RTR -> RTS towards remote_qpn. RoCE needs the GRH (is_global). */
static void connect_qp(struct ibv_qp *qp, uint32_t remote_qpn, const union ibv_gid *gid, int gid_index,
                       enum ibv_mtu mtu)
{
    struct ibv_qp_attr a = {
        .qp_state = IBV_QPS_RTR,
        .path_mtu = mtu,
        .dest_qp_num = remote_qpn,
        .rq_psn = 0,
        .max_dest_rd_atomic = 1,
        .min_rnr_timer = 12,
        .ah_attr = {
            .is_global = 1,
            .grh = {.dgid = *gid, .sgid_index = (uint8_t)gid_index, .hop_limit = 1},
            .port_num = PORT,
        },
    };
    int rc = ibv_modify_qp(qp, &a,
                           IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                               IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
    if (rc)
        die("modify_qp RTR", rc);
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.sq_psn = 0;
    a.max_rd_atomic = 1;
    rc = ibv_modify_qp(qp, &a,
                       IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                           IBV_QP_MAX_QP_RD_ATOMIC);
    if (rc)
        die("modify_qp RTS", rc);
}

int main(int argc, char **argv)
{
    const char *want = argc > 1 ? argv[1] : getenv("MORI_RDMA_DEVICE");
    const char *gi = getenv("MORI_RDMA_GID_INDEX");
    int gid_index = gi ? atoi(gi) : 1;
    if (!want)
        want = "rxe0";
    double t0 = now();

    int n = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    if (!list)
        die("ibv_get_device_list", errno);
    struct ibv_device *dev = NULL;
    for (int i = 0; i < n; i++)
        if (!strcmp(ibv_get_device_name(list[i]), want))
            dev = list[i];
    if (!dev) {
        fprintf(stderr, "verbs_probe: FAILED: device %s not found (%d devices)\n", want, n);
        return 1;
    }
    struct ibv_context *ctx = ibv_open_device(dev);
    if (!ctx)
        die("ibv_open_device", errno);

    struct ibv_port_attr port;
    int rc = ibv_query_port(ctx, PORT, &port);
    if (rc)
        die("ibv_query_port", rc);
    if (port.state != IBV_PORT_ACTIVE) {
        fprintf(stderr, "verbs_probe: FAILED: port %d state %s\n", PORT, ibv_port_state_str(port.state));
        return 1;
    }
    union ibv_gid gid;
    if (ibv_query_gid(ctx, PORT, gid_index, &gid))
        die("ibv_query_gid", errno);
    char gid_str[INET6_ADDRSTRLEN];
    inet_ntop(AF_INET6, gid.raw, gid_str, sizeof(gid_str));
    printf("verbs_probe: %s port %d %s active_mtu %d, gid[%d] %s\n", want, PORT,
           ibv_port_state_str(port.state), 128 << port.active_mtu, gid_index, gid_str);

    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    if (!pd)
        die("ibv_alloc_pd", errno);
    unsigned char *src = aligned_alloc(4096, BUF_SIZE), *dst = aligned_alloc(4096, BUF_SIZE);
    if (!src || !dst)
        die("aligned_alloc", ENOMEM);
    for (unsigned i = 0; i < BUF_SIZE; i++)
        src[i] = (unsigned char)(i * 7 + (i >> 12));
    memset(dst, 0, BUF_SIZE);
    int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    struct ibv_mr *src_mr = ibv_reg_mr(pd, src, BUF_SIZE, access);
    if (!src_mr)
        die("ibv_reg_mr(src)", errno);
    struct ibv_mr *dst_mr = ibv_reg_mr(pd, dst, BUF_SIZE, access);
    if (!dst_mr)
        die("ibv_reg_mr(dst)", errno);

    struct ibv_cq *cq = ibv_create_cq(ctx, 8, NULL, NULL, 0);
    if (!cq)
        die("ibv_create_cq", errno);
    struct ibv_qp *a = make_qp(pd, cq), *b = make_qp(pd, cq);
    /* Loopback: both QPs use the same (own) GID as destination. */
    connect_qp(a, b->qp_num, &gid, gid_index, port.active_mtu);
    connect_qp(b, a->qp_num, &gid, gid_index, port.active_mtu);

    struct ibv_sge sge = {.addr = (uintptr_t)src, .length = BUF_SIZE, .lkey = src_mr->lkey};
    struct ibv_send_wr wr = {
        .wr_id = 42,
        .sg_list = &sge,
        .num_sge = 1,
        .opcode = IBV_WR_RDMA_WRITE,
        .send_flags = IBV_SEND_SIGNALED,
        .wr.rdma = {.remote_addr = (uintptr_t)dst, .rkey = dst_mr->rkey},
    };
    struct ibv_send_wr *bad;
    double t1 = now();
    rc = ibv_post_send(a, &wr, &bad);
    if (rc)
        die("ibv_post_send", rc);

    struct ibv_wc wc;
    int got = 0;
    while (!(got = ibv_poll_cq(cq, 1, &wc))) {
        if (now() - t1 > 10) {
            fprintf(stderr, "verbs_probe: FAILED: no completion within 10 s\n");
            return 1;
        }
    }
    if (got < 0)
        die("ibv_poll_cq", EIO);
    double t2 = now();
    if (wc.status != IBV_WC_SUCCESS || wc.wr_id != 42) {
        fprintf(stderr, "verbs_probe: FAILED: completion status %s (wr_id %llu)\n", ibv_wc_status_str(wc.status),
                (unsigned long long)wc.wr_id);
        return 1;
    }
    if (memcmp(src, dst, BUF_SIZE)) {
        size_t i = 0;
        while (src[i] == dst[i])
            i++;
        fprintf(stderr, "verbs_probe: FAILED: data mismatch at byte %zu\n", i);
        return 1;
    }
    printf("verbs_probe: RDMA WRITE of %u bytes QP %u -> QP %u verified in %.1f ms (%.0f MB/s); total %.2f s\n",
           BUF_SIZE, a->qp_num, b->qp_num, (t2 - t1) * 1e3, BUF_SIZE / (t2 - t1) / 1e6, t2 - t0);

    ibv_destroy_qp(a);
    ibv_destroy_qp(b);
    ibv_destroy_cq(cq);
    ibv_dereg_mr(src_mr);
    ibv_dereg_mr(dst_mr);
    ibv_dealloc_pd(pd);
    ibv_close_device(ctx);
    ibv_free_device_list(list);
    free(src);
    free(dst);
    printf("verbs_probe: OK\n");
    return 0;
}
