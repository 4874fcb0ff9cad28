#include "gpuq/common/params.hpp"

#include <charconv>
#include <cstring>

#include "gpuq/common/shm_layout.hpp"

namespace gpuq {
namespace {

constexpr uint8_t kTypeInt = 1;
constexpr uint8_t kTypeFloat = 2;
constexpr uint8_t kTypeString = 3;

bool valid_key(std::string_view key) {
  if (key.empty() || key.size() > kMaxParamKeyBytes) return false;
  for (char c : key) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '.';
    if (!ok) return false;
  }
  return true;
}

Error bad_param(const std::string& what) {
  return Error(ErrorCode::kInvalidArgument, what);
}

}  // namespace

Result<void> ParamWriter::add(std::string_view key, const ParamValue& value) {
  if (!valid_key(key)) {
    return bad_param("param key '" + std::string(key) + "' must be 1-32 characters of [a-z0-9_.]");
  }
  std::vector<uint8_t> e;
  e.push_back(static_cast<uint8_t>(key.size()));
  e.insert(e.end(), key.begin(), key.end());
  if (const auto* i = std::get_if<int64_t>(&value)) {
    e.push_back(kTypeInt);
    uint8_t b[8];
    std::memcpy(b, i, 8);
    e.insert(e.end(), b, b + 8);
  } else if (const auto* d = std::get_if<double>(&value)) {
    e.push_back(kTypeFloat);
    uint8_t b[8];
    std::memcpy(b, d, 8);
    e.insert(e.end(), b, b + 8);
  } else {
    const auto& s = std::get<std::string>(value);
    if (s.size() > kMaxParamStringBytes) {
      return bad_param("param '" + std::string(key) + "' string value is " +
                       std::to_string(s.size()) + " bytes, at most " +
                       std::to_string(kMaxParamStringBytes) + " allowed");
    }
    e.push_back(kTypeString);
    e.push_back(static_cast<uint8_t>(s.size()));
    e.insert(e.end(), s.begin(), s.end());
  }
  if (bytes_.size() + e.size() > kMaxParamBytes) {
    return bad_param("params exceed " + std::to_string(kMaxParamBytes) + " bytes at key '" +
                     std::string(key) + "'");
  }
  bytes_.insert(bytes_.end(), e.begin(), e.end());
  return {};
}

Result<ParamBlock> ParamBlock::parse(const uint8_t* data, size_t size) {
  if (size > kMaxParamBytes) {
    return bad_param("params_bytes is " + std::to_string(size) + ", at most " +
                     std::to_string(kMaxParamBytes));
  }
  ParamBlock block;
  size_t at = 0;
  while (at < size) {
    const size_t index = block.entries_.size();
    const std::string where = "params entry " + std::to_string(index);
    size_t key_len = data[at++];
    if (key_len == 0 || key_len > kMaxParamKeyBytes || at + key_len > size) {
      return bad_param(where + ": key length " + std::to_string(key_len) + " is invalid");
    }
    std::string key(reinterpret_cast<const char*>(data + at), key_len);
    at += key_len;
    if (!valid_key(key)) return bad_param(where + ": key has characters outside [a-z0-9_.]");
    if (at >= size) return bad_param(where + " ('" + key + "'): truncated before its type");
    uint8_t type = data[at++];
    Param p{key, int64_t{0}};
    if (type == kTypeInt || type == kTypeFloat) {
      if (at + 8 > size) return bad_param(where + " ('" + key + "'): truncated value");
      if (type == kTypeInt) {
        int64_t v;
        std::memcpy(&v, data + at, 8);
        p.value = v;
      } else {
        double v;
        std::memcpy(&v, data + at, 8);
        p.value = v;
      }
      at += 8;
    } else if (type == kTypeString) {
      if (at >= size) return bad_param(where + " ('" + key + "'): truncated string length");
      size_t len = data[at++];
      if (len > kMaxParamStringBytes || at + len > size) {
        return bad_param(where + " ('" + key + "'): string length " + std::to_string(len) +
                         " is invalid");
      }
      p.value = std::string(reinterpret_cast<const char*>(data + at), len);
      at += len;
    } else {
      return bad_param(where + " ('" + key + "'): unknown type " + std::to_string(type));
    }
    block.entries_.push_back(std::move(p));
  }
  return block;
}

const ParamValue* ParamBlock::find(std::string_view key) const noexcept {
  for (const auto& e : entries_) {
    if (e.key == key) return &e.value;
  }
  return nullptr;
}

Result<int64_t> ParamBlock::get_int(std::string_view key, int64_t fallback, int64_t min,
                                    int64_t max) const {
  const ParamValue* v = find(key);
  if (v == nullptr) return fallback;
  const auto* i = std::get_if<int64_t>(v);
  if (i == nullptr) return bad_param("param '" + std::string(key) + "' must be an integer");
  if (*i < min || *i > max) {
    return bad_param("param '" + std::string(key) + "' is " + std::to_string(*i) +
                     ", must be in [" + std::to_string(min) + ", " + std::to_string(max) + "]");
  }
  return *i;
}

Result<Param> parse_param_assignment(std::string_view text) {
  size_t eq = text.find('=');
  if (eq == std::string_view::npos || eq == 0) {
    return bad_param("--param '" + std::string(text) + "' must look like key=value");
  }
  std::string key(text.substr(0, eq));
  std::string_view val = text.substr(eq + 1);
  if (!valid_key(key)) {
    return bad_param("--param key '" + key + "' must be 1-32 characters of [a-z0-9_.]");
  }
  int64_t i = 0;
  auto r = std::from_chars(val.data(), val.data() + val.size(), i);
  if (!val.empty() && r.ec == std::errc() && r.ptr == val.data() + val.size()) {
    return Param{key, i};
  }
  double d = 0;
  auto rd = std::from_chars(val.data(), val.data() + val.size(), d);
  if (!val.empty() && rd.ec == std::errc() && rd.ptr == val.data() + val.size()) {
    return Param{key, d};
  }
  if (val.size() > kMaxParamStringBytes) {
    return bad_param("--param '" + key + "' value is longer than " +
                     std::to_string(kMaxParamStringBytes) + " bytes");
  }
  return Param{key, std::string(val)};
}

}  // namespace gpuq
