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
  void PartDone(StatusCode code, const std::string& msg = "") {
    if (IsError(code)) {
      std::lock_guard<std::mutex> lk(mu_);
      if (!IsError(first_code_)) {
        first_code_ = code;
        first_msg_ = msg;
      }
    }
    if (left_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    std::lock_guard<std::mutex> lk(mu_);
    status_->Update(first_code_, first_msg_);
  }

 private:
  StatusPtr status_;
  std::atomic<uint32_t> left_;
  std::mutex mu_;
  StatusCode first_code_ = StatusCode::SUCCESS;
  std::string first_msg_;
};

}  // namespace mori_torch
