-- Fixed window. State: "index count" in one string. The expiry is set once,
-- at the window's end, when the window's first request is counted; later
-- requests keep it (a refreshed expiry would keep the window from closing).
local function fixed_window(key, cap, w, cost, now)
  local idx = window_index(now, w)
  local count, fresh = 0, true
  local v = read_string(key)
  if v then
    local a, b = string.match(v, '^(%d+) (%S+)$')
    if tonumber(a) == idx then
      count, fresh = tonumber(b) or 0, false
    end
  end
  local ends = (idx + 1) * w - now
  if count + cost <= cap then
    return 1, math.max(cap - (count + cost), 0), 0, ends, function()
      local val = string.format('%d %.17g', idx, count + cost)
      if fresh then
        redis.call('SET', key, val, 'PXAT', fmt_int(math.ceil((idx + 1) * w / 1000)))
      else
        redis.call('SET', key, val, 'KEEPTTL')
      end
    end
  end
  return 0, math.max(cap - count, 0), ends, ends, nil
end
