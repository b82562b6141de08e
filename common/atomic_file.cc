#include "common/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

namespace grpo::common {
namespace {

Status Error(const std::string& file, const std::string& what, int err) {
  const std::string m = file + ": " + what + ": " + std::strerror(err);
  return err == ENOENT ? Status::NotFound(m) : Status::Internal(m);
}

}  // namespace

Status WriteFileAtomically(const std::string& path, std::string_view contents,
                           Durability durability) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Error(tmp, "cannot create", errno);
  Status status;
  for (size_t done = 0; done < contents.size() && status.ok();) {
    const ssize_t n = ::write(fd, contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      status = Error(tmp, "write failed", errno);
    } else {
      done += static_cast<size_t>(n);
    }
  }
  if (status.ok() && durability == Durability::kFsync && ::fsync(fd) != 0) {
    status = Error(tmp, "fsync failed", errno);
  }
  if (::close(fd) != 0 && status.ok()) status = Error(tmp, "close failed", errno);
  if (status.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    status = Error(path, "cannot rename " + tmp + " over it", errno);
  }
  if (!status.ok()) {
    ::unlink(tmp.c_str());
    return status;
  }
  if (durability == Durability::kFsync) {
    std::string dir = std::filesystem::path(path).parent_path().string();
    if (dir.empty()) dir = ".";
    const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir_fd < 0) return Error(dir, "cannot open to fsync", errno);
    const int rc = ::fsync(dir_fd);
    const int err = errno;
    ::close(dir_fd);
    if (rc != 0) return Error(dir, "fsync failed", err);
  }
  return Status::OK();
}

}  // namespace grpo::common
