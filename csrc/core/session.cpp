#include "core/session.h"

#include "core/transfer_args.h"

namespace mori_torch {

StatusPtr Session::Submit(bool is_read, Int64Span local_offsets, Int64Span remote_offsets, Int64Span sizes,
                          TransferUid uid) {
  return SubmitVia(local_, is_read, local_offsets, remote_offsets, sizes, uid);
}

StatusPtr Session::SubmitVia(const std::shared_ptr<LocalMemory>& local, bool is_read, Int64Span local_offsets,
                             Int64Span remote_offsets, Int64Span sizes, TransferUid uid) {
  auto status = MakeStatus();
  if (local_->retired()) {
    if (counters_) counters_->Rejected(is_read, StatusCode::ERR_NOT_FOUND);
    status->Update(StatusCode::ERR_NOT_FOUND,
                   "session: local memory " + std::to_string(local_->desc.id) + " was deregistered");
    return status;
  }
  TransferOp op;
  std::string msg;
  auto segs = NewSegmentBatch();
  StatusCode c = BuildSegments(local_offsets, remote_offsets, sizes, local->desc, remote_, segs.get(), &msg);
  op.segs = std::move(segs);
  if (c != StatusCode::SUCCESS) {
    if (counters_) counters_->Rejected(is_read, c);
    status->Update(c, msg);
    return status;
  }
  op.is_read = is_read;
  op.local = local;
  op.remote = remote_;
  op.uid = uid;
  op.status = status;
  TransferPath path = CurrentPath();
  AttachRecord(op, path.counters);
  driver_->Submit(std::move(op), std::move(path));
  return status;
}

TransferPath Session::CurrentPath() {
  PathHealth& health = driver_->health();
  const uint64_t generation = health.Generation();
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (generation == generation_) return path_;
  }
  TransferPath fresh;
  std::string msg;
  if (driver_->Route(local_->desc, remote_, &fresh, &msg) != StatusCode::SUCCESS) {
    std::lock_guard<std::mutex> lk(mu_);
    return path_;  // the engine is shutting down: the pinned path fails it
  }
  std::lock_guard<std::mutex> lk(mu_);
  // Pinned only once every path is healthy: until then each transfer is
  // routed anew (one of them may be a down path's probe).
  if (health.Stats().paths_down == 0) {
    path_ = fresh;
    generation_ = generation;
  }
  return fresh;
}

BackendType Session::backend_type() const {
  std::lock_guard<std::mutex> lk(mu_);
  return path_.backend->Type();
}

std::shared_ptr<BackendPeer> Session::peer() const {
  std::lock_guard<std::mutex> lk(mu_);
  return path_.peer;
}

// Single transfers pass their scalars as one-element spans: no allocation.
StatusPtr Session::Read(int64_t lo, int64_t ro, int64_t size, TransferUid uid) {
  return Submit(true, {&lo, 1}, {&ro, 1}, {&size, 1}, uid);
}
StatusPtr Session::Write(int64_t lo, int64_t ro, int64_t size, TransferUid uid) {
  return Submit(false, {&lo, 1}, {&ro, 1}, {&size, 1}, uid);
}
StatusPtr Session::BatchRead(Int64Span lo, Int64Span ro, Int64Span sizes, TransferUid uid) {
  return Submit(true, lo, ro, sizes, uid);
}
StatusPtr Session::BatchWrite(Int64Span lo, Int64Span ro, Int64Span sizes, TransferUid uid) {
  return Submit(false, lo, ro, sizes, uid);
}

bool Session::Alive() const { return !local_->retired() && peer()->Alive(); }

}  // namespace mori_torch
