// CPU lists in the kernel's list format ("0-3,8"), as taskset, cpuset and sysfs's
// local_cpulist write them: for logs and the status table.
#pragma once

#include <string>
#include <vector>

namespace gpuq {

// `cpus` sorted ascending; runs of consecutive numbers become "a-b". Empty for no CPUs.
template <typename Int>
std::string cpu_list_text(const std::vector<Int>& cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(cpus[i]);
    if (j > i) out += '-' + std::to_string(cpus[j]);
    i = j + 1;
  }
  return out;
}

}  // namespace gpuq
