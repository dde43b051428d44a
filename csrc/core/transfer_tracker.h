// Completes one TransferStatus from several independently finishing parts
// (stripes over connections, QPs or streams): the first error is kept and
// reported once the last part is done, so the caller never sees SUCCESS or
// an error while some part may still touch its memory.
#pragma once

#include <atomic>
#include <mutex>
#include <string>

#include "core/transfer_status.h"

namespace mori_torch {

class TransferTracker {
 public:
  TransferTracker(StatusPtr status, uint32_t parts) : status_(std::move(status)), left_(parts) {}
  // `path_failed`: see TransferStatus::Update.
  void PartDone(StatusCode code, const std::string& msg = "", bool path_failed = false) {
    if (IsError(code)) {
      std::lock_guard<std::mutex> lk(mu_);
      if (!IsError(first_code_)) {
        first_code_ = code;
        first_msg_ = msg;
        first_path_failed_ = path_failed;
      }
    }
    if (left_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    StatusCode code_out;
    std::string msg_out;
    bool path_out;
    {
      std::lock_guard<std::mutex> lk(mu_);
      code_out = first_code_;
      msg_out = std::move(first_msg_);
      path_out = first_path_failed_;
    }
    // Unlocked: the status's outcome hook may start another attempt.
    status_->Update(code_out, msg_out, path_out);
  }

 private:
  StatusPtr status_;
  std::atomic<uint32_t> left_;
  std::mutex mu_;
  StatusCode first_code_ = StatusCode::SUCCESS;
  std::string first_msg_;
  bool first_path_failed_ = false;
};

}  // namespace mori_torch
